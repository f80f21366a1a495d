"""Result files: every number the README quotes comes from one of these JSON files, which
record the command that produced them, the date, the machine and the git commit."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    if os.environ.get("GENREC_COMMIT"):  # a copied tree whose git metadata is not the source's
        return os.environ["GENREC_COMMIT"] + " (as given by GENREC_COMMIT)"
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def command_line() -> str:
    """The command as typed: `python -m package.module args` for modules of this repository."""
    if not sys.argv:
        return ""
    script, args = Path(sys.argv[0]).resolve(), sys.argv[1:]
    if script.suffix == ".py" and REPO_ROOT in script.parents:
        module = ".".join(script.relative_to(REPO_ROOT).with_suffix("").parts)
        return " ".join(["python", "-m", module, *args])
    return " ".join(["python", *sys.argv])


def write_result(path, rows: list[dict], *, command: str | None = None, **extra) -> dict:
    """Write {command, date, machine, commit, rows, ...} to `path` (JSON) and return it."""
    blob = {
        "command": command or command_line(),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "commit": git_commit(),
        **extra,
        "rows": rows,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # paths inside the repository are written relative to it: results don't name this machine
    text = json.dumps(blob, indent=2, default=float).replace(str(REPO_ROOT) + os.sep, "")
    path.write_text(text + "\n")
    return blob


def markdown_table(rows: list[dict], columns: list[str], floatfmt: str = ".4f") -> str:
    def fmt(v):
        if isinstance(v, float):
            return format(v, floatfmt)
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
