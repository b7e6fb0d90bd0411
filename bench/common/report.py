"""What every benchmark writes: machine/build info, markdown tables, and the JSON + markdown pair.

Every benchmark writes two files under bench/results/ (or the directory it is given):

- ``{name}.json``: the benchmark's own data, its summary table and a
  ``machine`` dict (CPU, cores, load average, Python/NumPy versions, the
  installed pyllama-paged and libggml-python versions, the native library's
  path and version string, the git commit of the source tree);
- ``{name}.md``: a title, the summary table as markdown, optional notes and a
  one-paragraph machine line, so a reader of the repository sees the numbers
  without running anything.

Only the markdown (and the PNG a script draws beside it) is committed; bench/.gitignore keeps
the JSON and logs out of git.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni",
              "avx512_bf16", "amx_tile", "neon", "asimd", "sve")


# ---- machine and build info ---------------------------------------------------

def _cpu_info() -> dict[str, Any]:
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and model is None:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    if not model:
        model = platform.processor() or platform.machine()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "isa": [f for f in _ISA_FLAGS if f in flags],
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _native_info() -> dict[str, Any]:
    """Where the installed package and its native library live, and its version."""
    try:
        import pyllama_paged
        from pyllama_paged import _native
    except Exception as exc:  # the benchmark will fail on its own; still report why
        return {"import_error": f"{type(exc).__name__}: {exc}"}
    info: dict[str, Any] = {
        "package_dir": str(Path(pyllama_paged.__file__).resolve().parent),
        "library": str(_native.LIBRARY_PATH),
        "header": str(_native.HEADER_PATH),
        "package_version": getattr(pyllama_paged, "__version__", None),
    }
    try:
        info["native_version"] = _native.ffi.string(_native.lib.pp_version()).decode()
    except Exception:
        info["native_version"] = None
    return info


def nvidia_gpus() -> list[dict[str, str]]:
    """The NVIDIA GPUs nvidia-smi lists (index, name, memory, driver, compute capability);
    [] without nvidia-smi or when it lists none or fails (no driver)."""
    fields = ("index", "name", "memory.total", "driver_version", "compute_cap")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [dict(zip(fields, (c.strip() for c in line.split(","))))
            for line in out.stdout.splitlines() if line.count(",") == len(fields) - 1]


def machine_info(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A dict describing the machine, the software versions and the source tree."""
    import numpy

    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain")
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    info: dict[str, Any] = {
        **_cpu_info(),
        "loadavg_1_5_15": load,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "numpy": numpy.__version__,
        "pyllama_paged": _version("pyllama-paged"),
        "libggml_python": _version("libggml-python"),
        "cffi": _version("cffi"),
        "native": _native_info(),
        "git_commit": commit,  # None before the first commit
        "git_dirty": bool(status) if status is not None else None,
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
    }
    if extra:
        info.update(extra)
    return info


def machine_line(m: Mapping[str, Any]) -> str:
    """One human line summarizing machine_info() for the markdown files."""
    commit = m.get("git_commit")
    commit = (commit[:12] + ("+dirty" if m.get("git_dirty") else "")) if commit else "uncommitted tree"
    isa = ",".join(m.get("isa") or []) or "?"
    return (f"{m.get('cpu_model')} ({m.get('cpu_usable')} usable of {m.get('cpu_count')} CPUs; "
            f"{isa}), load avg {m.get('loadavg_1_5_15')}; Python {m.get('python')}, "
            f"NumPy {m.get('numpy')}, pyllama-paged {m.get('pyllama_paged')}, "
            f"libggml-python {m.get('libggml_python')}; source {commit}; "
            f"{m.get('timestamp_utc')}")


# ---- tables -----------------------------------------------------------------

def format_value(v: Any) -> str:
    """Compact human formatting: ints with thousands separators, floats to ~3-4
    significant digits, None as '-'. Strings pass through."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1e5:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        if a >= 1e-3:
            return f"{v:.3f}"
        return f"{v:.2e}"
    return str(v)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub markdown table of rows (dicts). Columns default to the union of
    the rows' keys in first-seen order; missing cells print as '-'. Numeric
    columns are right-aligned."""
    if not rows:
        return "(no rows)\n"
    if columns is None:
        columns = []
        for row in rows:
            for k in row:
                if k not in columns:
                    columns.append(k)
    cells = [[format_value(row.get(c)) for c in columns] for row in rows]
    numeric = [all(isinstance(row.get(c), (int, float)) or row.get(c) is None for row in rows)
               for c in columns]
    widths = [max(len(str(c)), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]

    def line(values: Iterable[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                         for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(str(c) for c in columns), sep, *(line(r) for r in cells)]) + "\n"


# ---- output -----------------------------------------------------------------

def jsonable(x: Any) -> Any:
    """Convert NumPy scalars/arrays, Paths, tuples and non-finite floats for JSON."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if np is not None:
        if isinstance(x, np.ndarray):
            return jsonable(x.tolist())
        if isinstance(x, np.generic):
            return jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def write_results(name: str, data: Mapping[str, Any], table_rows: Sequence[Mapping[str, Any]], *,
                  out_dir: str | os.PathLike | None = None, title: str | None = None,
                  notes: str | None = None, columns: Sequence[str] | None = None,
                  extra_machine: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Write {out_dir}/{name}.json (data + 'table' + 'machine') and {name}.md
    (title, table, notes, machine line). Returns the two paths."""
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info(extra_machine)
    payload = {"benchmark": name, **dict(data), "table": list(table_rows), "machine": machine}
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(jsonable(payload), indent=1) + "\n", encoding="utf-8")

    md = [f"# {title or name}", "", markdown_table(table_rows, columns)]
    if notes:
        md += [notes.strip(), ""]
    md += [f"Machine: {machine_line(machine)}", ""]
    md_path = out / f"{name}.md"
    md_path.write_text("\n".join(md), encoding="utf-8")
    return {"json": json_path, "md": md_path}


def write_report(name: str, args, data: Mapping[str, Any], table_rows: Sequence[Mapping[str, Any]], *,
                 out_dir: str | os.PathLike, title: str, notes: str | None = None, plot=None) -> int:
    """A script's usual ending: write_results of its options (as "params") and data into out_dir,
    then plot(out_dir/{name}.png) when given; 0, the script's exit status."""
    out = Path(out_dir)
    write_results(name, {"params": vars(args), **data}, table_rows, out_dir=out, title=title, notes=notes)
    if plot is not None:
        plot(out / f"{name}.png")
    return 0


def script_parser(doc: str | None) -> "argparse.ArgumentParser":
    """A benchmark's argument parser: its docstring's first paragraph as the description, defaults shown."""
    import argparse
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def save_npl_figure(fig, ax, npl, ylabel: str, title: str, path, rows,
                    xlabel: str = "parallel sequences (npl)") -> int:
    """Finish a plot over parallel sequences (npl on a log axis), write it, print the rows' table;
    0, a script's exit status."""
    ax.set(xscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ax.set_xticks(npl, [str(n) for n in npl])
    ax.legend()
    save_figure(fig, path)
    print(markdown_table(rows))
    return 0


def save_figure(fig, path, dpi: int = 100) -> None:
    """Lay out a finished figure and write it (the plots the summaries show)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
