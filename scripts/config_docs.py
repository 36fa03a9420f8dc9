"""Regenerate the configuration reference tables in the docs from the config schemas.

    python scripts/config_docs.py          # rewrite the tables in place
    python scripts/config_docs.py --check  # exit 1 if a table is out of date (tests do this)

Each table sits between ``<!-- config-reference:NAME:start/end -->`` markers; its rows come
from models.settings.reference_table (the field docstrings and defaults: one source).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tables() -> dict[tuple[str, str], str]:
    """{(doc file, marker name): its generated table}."""
    from generator.config import GeneratorConfig
    from models.settings import reference_table
    from pipeline.config.run import RunConfig
    from pipeline.config.sections import RUN_MANAGED

    managed = {f"generators.{k}": f"(set by `looprl run` from {v}; refused here)"
               for k, v in RUN_MANAGED.items()}  # fmt: skip
    return {
        ("docs/PIPELINE.md", "run"): reference_table(RunConfig, managed),
        ("docs/GENERATOR.md", "generator"): reference_table(GeneratorConfig),
    }


def main(argv: list[str]) -> int:
    from models.settings import splice_reference

    stale = []
    for (doc, name), table in tables().items():
        path = ROOT / doc
        old = path.read_text()
        new = splice_reference(old, name, table)
        if new != old:
            stale.append(doc)
            if "--check" not in argv:
                path.write_text(new)
    if stale and "--check" in argv:
        print(f"out of date: {', '.join(stale)} (run python scripts/config_docs.py)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
