"""The built-in models' quality: held-out bits per byte against lzma and zlib on the same files.

python -m benchmarks model [--quick] [--model DIR]
"""

from __future__ import annotations

import json
import lzma
import math
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Suite, Table
from kimi_linear_jax import corpus
from kimi_linear_jax.checkpoint import BUILTIN_DRAFT, BUILTIN_MODEL, load_model_and_tokenizer
from kimi_linear_jax.train import token_nll

SUITE = Suite("model", __doc__)
SUITE.option("--model", nargs="+", help="model directories (default: both built-in models)")


def file_bits(nll_fn, ids: list[int], eos: int, window: int) -> float:
    """Sum of -log2 p over ``ids``, the first after the document separator, each token scored
    once with a sliding window advanced by half a window (so with at least half a window of
    context, or the whole file before it)."""
    stream = np.asarray([eos, *ids], np.int32)
    bits, scored, start = 0.0, 0, 0
    while scored < len(ids):
        chunk = stream[start : start + window + 1]
        # Padded to one shape (one compile); a causal model's earlier positions ignore the pad.
        padded = np.pad(chunk, (0, window + 1 - len(chunk)), constant_values=eos)
        nll = np.asarray(nll_fn(jnp.asarray(padded[None])))[0, : len(chunk) - 1]
        bits += float(nll[scored - start :].sum()) / math.log(2)  # nll[i] scores ids[start + i]
        scored = start + len(chunk) - 1
        start += window // 2
    return bits


def compressed_bits(data: bytes) -> dict[str, float]:
    return {
        "lzma": 8.0 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)),
        "zlib": 8.0 * len(zlib.compress(data, 9)),
    }


@SUITE.measure("bpb")
def bpb(args) -> list[Table]:
    """Held-out bits per byte of each built-in model (``pycode``, ``pycode-draft``) against
    lzma (preset 9, extreme) and zlib (level 9), on each held-out file of the model's
    ``data.json`` alone and on all of them concatenated (one stream: the compressors see the
    other files, the model does not). No timing: the same on any machine.
    """
    tables = []
    for model_dir in args.model or [BUILTIN_MODEL, BUILTIN_DRAFT]:
        split = json.load(open(os.path.join(model_dir, "data.json")))
        window = split["seq_len"]
        model, tok = load_model_and_tokenizer(model_dir, "float32")
        eos = model.config.eos_token_ids[0]
        nll_fn = jax.jit(lambda ids, model=model: token_nll(model, ids))
        root = corpus.stdlib_dir()
        files = [(name, root / name) for name in split["held_out"] if (root / name).is_file()]
        if args.quick:  # the three shortest
            files = sorted(files, key=lambda f: f[1].stat().st_size)[:3]
        rows, texts = [], []
        for name, path in files:
            text = path.read_text(encoding="utf-8")
            data = text.encode()
            texts.append(data)
            row = {"file": name, "bytes": len(data)}
            row["model_bits"] = file_bits(nll_fn, tok.encode(text), eos, window)
            row.update({f"{k}_bits": v for k, v in compressed_bits(data).items()})
            rows.append(row)
        total = {"file": "ALL (per file)", "bytes": sum(r["bytes"] for r in rows)}
        total.update({k: sum(r[k] for r in rows) for k in ("model_bits", "lzma_bits", "zlib_bits")})
        joined = {"file": "ALL (concatenated)", "bytes": total["bytes"]}
        joined["model_bits"] = total["model_bits"]
        joined.update({f"{k}_bits": v for k, v in compressed_bits(b"".join(texts)).items()})
        rows += [total, joined]
        for r in rows:
            for key in ("model", "lzma", "zlib"):
                r[f"{key}_bpb"] = r[f"{key}_bits"] / r["bytes"]
            r["model/lzma"] = r["model_bpb"] / r["lzma_bpb"]
        name = os.path.basename(os.path.normpath(model_dir))
        title = f"{name}: bits per byte, window {window}, stride {window // 2}"
        columns = ["file", "bytes", "model_bpb", "lzma_bpb", "zlib_bpb", "model/lzma"]
        tables.append(Table(title, rows, columns, {"window": window}))
    return tables
