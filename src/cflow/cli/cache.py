"""`cflow cache [list|clear] [MATCH]`: the GGUF conversions cflow keeps (cflow.runtime.files), where
they are, how much room they take against the limit, and removing them."""

from __future__ import annotations

import argparse
import datetime as _dt
import json

from cflow.cli.common import FileError, add_command


HELP = """\
list or clear the cached conversions of GGUF files

A .gguf given to generate, chat or bench is converted once into the cache and reused while the
GGUF is unchanged. `cflow cache` lists each conversion (its file, the GGUF it came from, its size,
when it was last used), the total and the limit; when a new conversion would not fit, the least
recently used ones are removed. `cflow cache clear` removes them all, or those whose file or
source GGUF name contains MATCH.

The cache lives in $CFLOW_CACHE (default ~/.cache/cflow); its limit is $CFLOW_CACHE_MAX (default
20G; e.g. 500M, 2G). Sizes are decimal: MB = 10^6 bytes.

examples:
  cflow cache
  cflow cache list --json
  cflow cache clear SmolLM2        # only conversions of SmolLM2 GGUFs
  CFLOW_CACHE_MAX=2G cflow cache   # the total against another limit
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "cache", HELP)
    p.add_argument("action", nargs="?", choices=["list", "clear"], default="list",
                   help="list (the default) or clear")
    p.add_argument("match", nargs="?", metavar="MATCH",
                   help="only the conversions whose file or source GGUF name contains MATCH")
    p.add_argument("--json", action="store_true", help="list: print one JSON object instead of a table")
    p.set_defaults(func=run)


def _when(t: float) -> str:
    return _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")


def run(args: argparse.Namespace) -> int:
    from cflow.runtime import files

    limit = files.cache_limit()  # a bad CFLOW_CACHE_MAX is said before anything else
    if args.action == "clear":
        return _clear(files, args.match)
    chosen = [e for e in files.entries() if args.match is None or args.match in e.path.name
              or args.match in e.source]
    total = sum(e.nbytes for e in chosen)
    if args.json:
        print(json.dumps({"dir": str(files.gguf_dir()), "limit_bytes": limit, "total_bytes": total,
                          "entries": [{"path": str(e.path), "source": e.source, "bytes": e.nbytes,
                                       "last_used": _dt.datetime.fromtimestamp(e.last_used).isoformat(
                                           timespec="seconds")} for e in chosen]}, indent=2))
        return 0
    fmt = files.format_size
    print(f"cache     {files.gguf_dir()} ($CFLOW_CACHE, default ~/.cache/cflow)")
    if chosen:
        print()
        w = max(len(e.path.name) for e in chosen)
        print(f"{'file':<{w}}  {'size':>9}  {'last used':<16}  source")
        for e in chosen:
            print(f"{e.path.name:<{w}}  {fmt(e.nbytes):>9}  {_when(e.last_used):<16}  {e.source}")
        print()
    what = "no conversions" if not chosen else f"{len(chosen)} conversion(s)"
    if args.match is not None:
        what += f" matching {args.match!r}"
    print(f"total     {what}, {fmt(total)} of the {fmt(limit)} limit ($CFLOW_CACHE_MAX)")
    return 0


def _clear(files, match: str | None) -> int:
    try:
        gone = files.clear(match)
    except OSError as e:
        raise FileError(f"cannot remove {e.filename}: {e.strerror or e}") from None
    if not gone:
        print("nothing to remove" + (f": no conversion matches {match!r}" if match is not None else
                                     ": the cache holds no conversions"))
        return 0
    for e in gone:
        print(f"removed {e.path.name} ({files.format_size(e.nbytes)}, from {e.source})")
    print(f"freed {files.format_size(sum(e.nbytes for e in gone))} in {len(gone)} file(s)")
    return 0
