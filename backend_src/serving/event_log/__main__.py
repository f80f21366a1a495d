"""python -m backend_src.serving.event_log show|delete|sweep (the command line is in cli.py)."""
from backend_src.serving.event_log.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
