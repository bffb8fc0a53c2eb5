"""Held-out bits per byte of a trained model (default: the built-in `pycode`) next to lzma and
zlib on the same files, plus the model's training curve from its `train_log.jsonl`.

The held-out files are the ones the model's `data.json` lists (the training split), read from
the running interpreter's standard library. The model scores every token of a file, the first
one after the document separator the training stream puts between files, with a sliding
window of the training length (`--window`, default data.json's seq_len) advanced by half a
window: every token is predicted with at least half a window of context (the full file before
it when the file is shorter than the window). Bits = sum of -log2 p over the file's tokens;
bytes = the file's UTF-8 length (the separator itself is not scored).

Baselines: `lzma` (preset 9 | EXTREME, xz container) and `zlib` (level 9) on each file alone,
and on all held-out files concatenated (one stream, so the compressors see the other files
too; the model does not).

Run from the repo root: ``python benchmarks/heldout_bpb.py [--model DIR]``.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import print_table, write_json  # noqa: E402

from kimi_linear_jax import corpus  # noqa: E402
from kimi_linear_jax.checkpoint import BUILTIN_MODEL, load_model_and_tokenizer  # noqa: E402
from kimi_linear_jax.train import token_nll  # noqa: E402


def file_bits(nll_fn, ids: list[int], eos: int, window: int) -> float:
    """Sum of -log2 p over `ids`, each token scored once with a sliding window."""
    stream = np.asarray([eos, *ids], np.int32)
    bits, scored, start = 0.0, 0, 0
    while scored < len(ids):
        chunk = stream[start : start + window + 1]
        # Pad to one shape (one compile); a causal model's earlier positions ignore the pad.
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


def curve(model_dir: str) -> list[dict]:
    path = os.path.join(model_dir, "train_log.jsonl")
    if not os.path.isfile(path):
        return []
    rows = [json.loads(line) for line in open(path)]
    return [
        {k: r[k] for k in ("step", "loss", "eval_loss", "eval_bpb", "elapsed_s")}
        for r in rows
        if "eval_bpb" in r
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=BUILTIN_MODEL)
    p.add_argument("--window", type=int, default=None)
    a = p.parse_args(argv)
    split = json.load(open(os.path.join(a.model, "data.json")))
    window = a.window or split["seq_len"]
    model, tok = load_model_and_tokenizer(a.model, "float32")
    eos = model.config.eos_token_ids[0]
    nll_fn = jax.jit(lambda ids: token_nll(model, ids))
    root = corpus.stdlib_dir()
    rows, texts = [], []
    for name in split["held_out"]:
        path = root / name
        if not path.is_file():
            print(f"skipped {name}: not in this interpreter's standard library")
            continue
        text = path.read_text(encoding="utf-8")
        data = text.encode()
        texts.append(data)
        row = {"file": name, "bytes": len(data)}
        row["model_bits"] = file_bits(nll_fn, tok.encode(text), eos, window)
        row.update({f"{k}_bits": v for k, v in compressed_bits(data).items()})
        rows.append(row)
    total = {"file": "ALL (per file)", "bytes": sum(r["bytes"] for r in rows)}
    for key in ("model_bits", "lzma_bits", "zlib_bits"):
        total[key] = sum(r[key] for r in rows)
    joined = {
        "file": "ALL (concatenated)",
        "bytes": total["bytes"],
        "model_bits": total["model_bits"],
    }
    joined.update({f"{k}_bits": v for k, v in compressed_bits(b"".join(texts)).items()})
    rows += [total, joined]
    for r in rows:
        for key in ("model", "lzma", "zlib"):
            r[f"{key}_bpb"] = r[f"{key}_bits"] / r["bytes"]
        r["model_vs_lzma"] = r["model_bpb"] / r["lzma_bpb"]
    print_table(rows, ["file", "bytes", "model_bpb", "lzma_bpb", "zlib_bpb", "model_vs_lzma"])
    points = curve(a.model)
    if points:
        print("\ntraining curve (held-out windows during training)")
        print_table(points, ["step", "loss", "eval_loss", "eval_bpb", "elapsed_s"])
    meta = {"model": os.path.relpath(a.model), "window": window, "stride": window // 2}
    name = "heldout_bpb_" + os.path.basename(os.path.normpath(a.model))
    print("wrote", write_json(name, rows + [{"curve": points}], meta))
    return rows


if __name__ == "__main__":
    main()
