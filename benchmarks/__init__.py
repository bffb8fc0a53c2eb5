"""Benchmark suites of kimi-linear-jax: ``python -m benchmarks SUITE [--quick] [--out DIR]``.

One module per suite, all on the harness of ``benchmarks/harness.py``; ``all`` runs every
suite. Figures: ``benchmarks/RESULTS.md``. ``gpu_compile.py`` and ``mosaic_compile.py`` (``make
gpu-compile``, ``make gpu-compile-mosaic``) and ``gpu_check.sh`` (a lent GPU) stand apart.
"""

# Suite -> (module, what it measures). A suite's module is imported only when it runs: each
# imports JAX and the model, and some need a test extra (transformers, httpx).
SUITES = {
    "decode": (
        "benchmarks.decode",
        "offline throughput vs transformers and the roofline, decode profile, async "
        "scheduling, pool size, float32 vs bfloat16",
    ),
    "speculative": (
        "benchmarks.speculative",
        "n-gram / draft model / oracle vs plain decoding, verify window price, verify "
        "commit, draft price",
    ),
    "windows": (
        "benchmarks.windows",
        "verify window shapes: fixed widths vs cost-aware widths vs draft trees",
    ),
    "prefix": ("benchmarks.prefix", "prefix cache on vs off: TTFT and prefill tokens saved"),
    "server": ("benchmarks.server", "server load (req/s, TTFT, ITL) and hostile input costs"),
    "kernel": (
        "benchmarks.kernel",
        "MLA decode kernel, DCP combines, KDA prefill, forward vs transformers, MoE tiles",
    ),
    "parallel": (
        "benchmarks.parallel",
        "TP x DCP: memory per device, collective bytes, step time (8 emulated devices)",
    ),
    "model": ("benchmarks.model", "the built-in models' held-out bits per byte vs lzma, zlib"),
}
