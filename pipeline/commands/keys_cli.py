"""``looprl keys DIR``: CURVE keypairs for the learner and its generators.

Writes (directories 0700, every file 0600; see pipeline.net.security for who needs what)::

    DIR/learner.key, DIR/learner.key_secret        the learner's keypair
    DIR/generators/NAME.key[_secret]               one keypair per generator
    DIR/allowed/NAME.key                           their public keys, admitted by the learner

NAME is the identity the learner binds the key to: a generator holding it may only use the
generator id NAME or NAME:SUFFIX (pipeline.net.security.owns). Names are generator-NNN, or those
given with ``--name``. Existing keys are never overwritten: without ``--add`` an existing
learner key is an error; with ``--add`` the learner key is kept and new generators are
numbered after the existing ones. Keys are generated in a private temporary directory and
moved into place.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import zmq.auth

from pipeline.net.security import (
    ALLOWED_DIR,
    GENERATORS_DIR,
    LEARNER_NAME,
    SecurityError,
    check_key_name,
)

_GEN = re.compile(r"generator-(\d+)\.key_secret$")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "keys",
        help="create CURVE keypairs for the learner and generators",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("dir", help="key directory (created, mode 0700)")
    p.add_argument(
        "-n",
        "--generators",
        type=int,
        default=None,
        help="generator-NNN keypairs to create (default: 1, or 0 with --name)",
    )
    p.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="ID",
        help="a generator keypair named ID (the generator id it speaks for); repeatable; "
        "with --name, -n counts the generator-NNN keypairs to add besides (default: 0)",
    )
    p.add_argument(
        "--add",
        action="store_true",
        help="keep the existing learner key and add generator keypairs",
    )
    p.set_defaults(func=run)
    return p


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def create_keys(
    keys_dir: str | Path, generators: int, *, add: bool = False, names: Sequence[str] = ()
) -> list[Path]:
    """Create the key files; returns the generator secret-key files written (``names``
    first, then ``generators`` numbered ones)."""
    if generators < 0 or (generators + len(names) == 0 and add):
        raise SecurityError(f"--generators must be >= 0 (>= 1 with --add), got {generators}")
    for name in names:
        check_key_name(name)
    d = Path(keys_dir)
    learner_secret = d / f"{LEARNER_NAME}.key_secret"
    if learner_secret.exists() and not add:
        raise SecurityError(f"{learner_secret} exists; use --add to add generator keys")
    if add and not learner_secret.exists():
        raise SecurityError(f"--add: no learner key in {d} (run without --add first)")
    for sub in (d, d / GENERATORS_DIR, d / ALLOWED_DIR):
        _private_dir(sub)
    tmp = Path(tempfile.mkdtemp(prefix=".keys-", dir=d))  # 0700: nobody sees a secret early
    try:
        if not add:
            _make(tmp, LEARNER_NAME, d)
        taken = [
            int(m.group(1)) for f in (d / GENERATORS_DIR).iterdir() if (m := _GEN.match(f.name))
        ]
        start = max(taken, default=-1) + 1
        todo = [*names, *(f"generator-{i:03d}" for i in range(start, start + generators))]
        for i, name in enumerate(todo):  # check all first: nothing is written for a taken name
            if (d / ALLOWED_DIR / f"{name}.key").exists() or name in todo[:i]:
                raise SecurityError(f"key name {name} is taken in {d}; pick another name")
        written = []
        for name in todo:
            _make(tmp, name, d / GENERATORS_DIR)
            shutil.copy2(d / GENERATORS_DIR / f"{name}.key", d / ALLOWED_DIR / f"{name}.key")
            os.chmod(d / ALLOWED_DIR / f"{name}.key", 0o600)
            written.append(d / GENERATORS_DIR / f"{name}.key_secret")
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make(tmp: Path, name: str, dest: Path) -> None:
    public, secret = (Path(p) for p in zmq.auth.create_certificates(tmp, name))
    for f in (public, secret):
        os.chmod(f, 0o600)
        target = dest / f.name
        if target.exists():
            raise SecurityError(f"{target} exists; refusing to overwrite a key")
        os.replace(f, target)


def run(args: argparse.Namespace) -> int:
    n = args.generators if args.generators is not None else (0 if args.name else 1)
    written = create_keys(args.dir, n, add=args.add, names=args.name)
    d = Path(args.dir)
    if not args.add:
        print(f"learner keypair: {d / (LEARNER_NAME + '.key_secret')} (keep on the learner host)")
    for f in written:
        gid = f.name.removesuffix(".key_secret")
        print(
            f"generator keypair: {f} (copy to its host with {d / (LEARNER_NAME + '.key')}; "
            f"it speaks for generator id {gid} or {gid}:SUFFIX)"
        )
    print(f"admitted generator keys: {d / ALLOWED_DIR}/")
    return 0
