"""Write docs/config.md, the reference of every config key, from the code.

    .venv/bin/python scripts/docs_reference.py

tests/test_docs.py keeps the page equal to what this writes, so a key added, removed
or re-documented in hookloop.config shows up here (run the script again).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"

INTRO = """\
# Configuration keys

Every key `hookloop train` takes, with its default and what it means, generated from
`hookloop.config` by `scripts/docs_reference.py` (a test keeps this page equal to it).
`hookloop config [--recipe NAME]` prints the same keys with a recipe's values. Set them
in a YAML file (`--config FILE.yaml`) or as dotted overrides (`train.max_steps=60`); see
[the command line](cli.md).
"""


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def config_reference() -> str:
    """The page: one table per section, a row per key (default, meaning)."""
    from hookloop.config import Config, describe

    sections: dict[str, list[tuple[str, Any, str]]] = {}
    for key, value, doc in describe(Config()):
        section = key.split(".", 1)[0] if "." in key else "(top level)"
        sections.setdefault(section, []).append((key, value, doc))
    parts = [INTRO.rstrip("\n")]
    for section, rows in sections.items():
        parts.append(f"## {section}\n\n| key | default | meaning |\n|---|---|---|")
        for key, value, doc in rows:
            meaning = doc.replace("|", "\\|")
            parts[-1] += f"\n| `{key}` | `{_value(value)}` | {meaning} |"
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    PAGE.write_text(config_reference(), encoding="utf-8")
    print(f"wrote {PAGE}")
