"""``hookloop`` commands run in the test's process, their output captured (not collected)."""

from __future__ import annotations

import contextlib
import io

from hookloop.app.cli import main


def run_cli(argv: list) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``hookloop ARGV`` (argparse's refusals included)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:  # argparse's own refusals
            code = exit_.code
    return int(code), out.getvalue(), err.getvalue()
