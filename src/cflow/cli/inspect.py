"""`cflow inspect FILE`: what a .cflow/.vflow file holds, checked as the engine would check it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cflow.cli.common import FileError, add_command
from cflow.runtime.files import format_size


HELP = """\
show the config, tensors, byte split and expert table of a .cflow/.vflow file

Validate a model file (magic, version, header, offsets, sizes, alignment) and show its config,
data order, tensor table, bytes by category and expert offset table. Every problem is reported
as a named error with what to do about it. Sizes are decimal: MB = 10^6 bytes.

examples:
  cflow inspect smollm2.cflow --verify
  cflow inspect smollm2.cflow --json | jq '.tensors[] | select(.dtype == "q8_0") | .name'
  cflow cache                      # where converted GGUFs are, to inspect them
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "inspect", HELP)
    p.add_argument("file", help="a .cflow or .vflow model file")
    p.add_argument("--verify", action="store_true", help="also check every tensor's checksum (reads all bytes)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


def report(path: str, verify: bool = False) -> dict[str, Any]:
    """Everything `inspect` shows, as one JSON-serializable dict."""
    from cflow import fileformat as F
    from cflow import weights

    with F.open_model(path, verify=verify, mmap=True, require_complete=False) as cf:
        out = F.summarize(cf)
        out["verified"] = verify
        out["config"] = cf.config.to_dict()
        # a config claiming far more tensors than the file holds is reported by count, not listed
        split = weights.split_qkv_sets(cf.tensors)
        n_expected = F.expected_count(cf.config, split)
        out["missing_tensors"] = ([n for n in F.model_tensors(cf.config, split_qkv=split) if n not in cf.tensors]
                                  if n_expected <= 10 * len(cf.tensors) + 1000 else [f"{n_expected} expected"])
        out["tokenizer"] = {"model": cf.tokenizer.get("model"), "vocab": len(cf.tokenizer.get("vocab") or []),
                            "merges": len(cf.tokenizer.get("merges") or []),
                            "chat_template": bool(cf.tokenizer.get("chat_template"))}
        out["metadata"] = cf.metadata
        out["tensors"] = [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "layout": e.layout,
                           "offset": e.offset, "nbytes": e.nbytes, "category": F.tensor_category(e.name)}
                          for e in sorted(cf.tensors.values(), key=lambda e: e.offset)]
        out["expert_table"] = [{"layer": k[0], "expert": k[1], "offset": o, "nbytes": n}
                               for k, (o, n) in sorted(cf.experts.items())]
    return out


def _mb(n: int) -> str:  # the tensor table's MB column
    return f"{n / 1e6:.3f}"


def _print_text(r: dict[str, Any]) -> None:
    print(f"file      {r['path']}")
    order = "stage order" if r["order"] == "vflow" else "layer by layer"
    print(f"format    cflow v{r['version']}, order {r['order']} ({order}), "
          f"{format_size(r['file_bytes'])}, header {format_size(r['header_bytes'])}, data from byte {r['data_start']}")
    print(f"tiles     {r['tile'][0]}x{r['tile'][1]}, alignment {'ok' if r['aligned'] else 'BROKEN'} (4096), "
          f"padding {format_size(r['padding_bytes'])}, "
          f"checksums {'verified' if r['verified'] else 'not checked (--verify)'}")
    cfg = r["config"]
    print("config    " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    t = r["tokenizer"]
    print(f"tokenizer {t['model']}, {t['vocab']} tokens, {t['merges']} merges, "
          f"chat template {'yes' if t['chat_template'] else 'no'}")
    if r["missing_tensors"]:
        print(f"WARNING   {len(r['missing_tensors'])} tensor(s) the config needs are missing, e.g. "
              f"{r['missing_tensors'][:3]}")
    print()
    w = max([len(e["name"]) for e in r["tensors"]] + [4])
    print(f"{'name':<{w}}  {'dtype':<5}  {'shape':<14}  {'layout':<6}  {'MB':>9}  {'offset':>12}")
    for e in r["tensors"]:
        shape = "x".join(str(s) for s in e["shape"])
        print(f"{e['name']:<{w}}  {e['dtype']:<5}  {shape:<14}  {e['layout']:<6}  "
              f"{_mb(e['nbytes']):>9}  {e['offset']:>12}")
    print()
    total = sum(r["bytes_by_category"].values()) or 1
    print("bytes by category")
    for cat, n in sorted(r["bytes_by_category"].items(), key=lambda kv: -kv[1]):
        print(f"  {cat:<11} {format_size(n):>10}  {100 * n / total:5.1f}%")
    ex = r["experts"]
    if ex["count"]:
        print(f"experts   {ex['count']} blocks over {ex['layers']} layer(s), "
              f"{format_size(ex['min_bytes'])}–{format_size(ex['max_bytes'])} each, "
              f"{format_size(ex['total_bytes'])} in all, each one aligned contiguous read")
    else:
        print("experts   none")


def run(args: argparse.Namespace) -> int:
    try:
        r = report(args.file, verify=args.verify)
    except OSError as e:  # e.g. no permission to read it
        raise FileError(f"cannot read {args.file}: {e.strerror or e}") from None
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        _print_text(r)
    return 0
