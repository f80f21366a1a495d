"""The admin key: who may load and unload models, and use shared memory, trace and logging.

Inference, health, metadata, model config and statistics stay open; the APIs in
``RESTRICTED_APIS`` need the key in a request header. The key comes from GENREC_ADMIN_KEY or a
key file (``runs/admin.key`` beside the server's pid file by default, created with mode 0600 at
the first start).
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path

ADMIN_KEY_ENV = "GENREC_ADMIN_KEY"
# what the models get instead of the key: its SHA-256, against which the catalog checks the key a
# change carries (a model never holds the key itself)
ADMIN_KEY_DIGEST_ENV = "GENREC_ADMIN_KEY_SHA256"
DEFAULT_ADMIN_KEY_FILE = Path("runs") / "admin.key"
ADMIN_HEADER = "genrec-admin-key"
# Triton checks a restricted gRPC protocol's header under this prefix (an HTTP API's header as
# it is named); the server says so when it refuses a call.
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
_KEY_CHARS = re.compile(r"^[A-Za-z0-9._~-]{16,256}$")  # safe inside a flag and a header


def check_admin_key(key: str, where: str) -> str:
    """The key without surrounding whitespace; ValueError naming `where` when it is not 16-256
    characters a flag and a header can carry."""
    key = key.strip()
    if not _KEY_CHARS.match(key):
        raise ValueError(f"admin key from {where}: 16-256 characters of A-Z a-z 0-9 . _ ~ - expected")
    return key


def read_admin_key(path=None) -> str | None:
    """The admin key from the file `path` when one is named; else from GENREC_ADMIN_KEY, else
    from runs/admin.key. None when there is none."""
    if path is None and os.environ.get(ADMIN_KEY_ENV):
        return check_admin_key(os.environ[ADMIN_KEY_ENV], ADMIN_KEY_ENV)
    path = Path(path) if path else DEFAULT_ADMIN_KEY_FILE
    try:
        return check_admin_key(path.read_text(), str(path))
    except FileNotFoundError:
        return None


def ensure_admin_key(path) -> str:
    """The key in the file `path`, creating it (mode 0600) with a random key when it is absent."""
    key = read_admin_key(path)
    if key:
        return key
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another start won the race: use its key
        return read_admin_key(path)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(key + "\n")
    return key


def admin_headers(key: str | None, protocol: str = "grpc") -> dict | None:
    """Request headers that carry the admin key, for tritonclient's `headers=`."""
    if not key:
        return None
    return {GRPC_ADMIN_HEADER if protocol == "grpc" else ADMIN_HEADER: key}


def restricted_api_flags(key: str) -> list:
    """tritonserver's flags that put the restricted APIs behind `key`. Triton takes the key only
    on its command line (so local users can read it in the process list); the threat kept out
    is anyone who can reach the ports."""
    apis = ",".join(RESTRICTED_APIS)
    return [
        f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={key}",
        f"--http-restricted-api={apis}:{ADMIN_HEADER}={key}",
    ]


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
