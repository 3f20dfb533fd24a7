"""The live dashboard in a real headless browser (Debian's chromium, driven by Playwright)
against a real training process: it loads, its curve grows, its Stop button stops the job.

The browser is installed here, once per session and only when this test runs: the
`chromium` fixture calls scripts/install-browser.sh (apt-get, as root) when no chromium
is found, so a fresh Debian machine runs the test and no other run pays for the install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from _control_support import Job

# The browser part only: installing chromium (the fixture) has its own limit, INSTALL_S.
pytestmark = pytest.mark.timeout(240, func_only=True)

INSTALL_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install-browser.sh"
INSTALL_S = 900  # apt-get update + chromium and its libraries on a slow mirror

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MS = 30_000  # browser-side waits, milliseconds


def _find_chromium() -> str | None:
    path = os.environ.get("HOOKLOOP_CHROMIUM") or "/usr/bin/chromium"
    if Path(path).is_file() and os.access(path, os.X_OK):
        return path
    return shutil.which("chromium")


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser's path; installs Debian's chromium first when there is none."""
    found = _find_chromium()
    if found:
        return found
    # The script is best effort: it exits 0 and says why when apt cannot install.
    done = subprocess.run(
        ["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=INSTALL_S
    )
    found = _find_chromium()
    if found:
        return found
    pytest.skip(
        "Debian's chromium is not installed and scripts/install-browser.sh could not install "
        f"it (exit {done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}"
    )


def test_dashboard_shows_a_growing_curve_and_its_stop_button_stops_the_job(tmp_path, chromium):
    executable = chromium
    from playwright.sync_api import sync_playwright

    job = Job(
        tmp_path / "job", tmp_path / "jobs", "dash-job", "callbacks.profile=true", sleep=0.005
    )
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"),
                executable_path=executable,
                headless=True,
                args=CHROMIUM_ARGS,
            )
            try:
                _drive(context, job)
            finally:
                context.close()
        assert job.wait_exit() == 0, job.stderr()
        (step,) = job.checkpoints().values()
        assert f"graceful_stop requested over HTTP at step {step}" in job.stderr()
    finally:
        job.kill()


def _drive(context, job: Job) -> None:
    page = context.new_page()
    problems: list[str] = []
    urls: list[str] = []
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    # (a refused token and the job's end log "Failed to load resource"; anything else,
    # such as a Content-Security-Policy violation, is a problem)
    page.on(
        "console",
        lambda msg: (
            problems.append(f"console {msg.type}: {msg.text}")
            if msg.type == "error" and not msg.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.on("request", lambda request: urls.append(request.url))
    page.on("dialog", lambda dialog: dialog.accept())  # the Stop button asks to confirm

    job.ready()
    page.goto(job.record.url, timeout=MS)
    page.wait_for_selector("#token", state="visible", timeout=MS)

    # a wrong token is refused and asked for again
    page.fill("#token", "not-the-token")
    page.click("#connect")
    page.wait_for_function(
        "() => document.getElementById('login-why').textContent.includes('not accepted')",
        timeout=MS,
    )

    page.fill("#token", job.token)
    page.click("#connect")
    page.wait_for_selector("#chart", state="visible", timeout=MS)
    page.wait_for_function(
        "() => Number(document.getElementById('chart').dataset.points) >= 2", timeout=MS
    )
    first = int(page.get_attribute("#chart", "data-points"))
    page.wait_for_function(
        f"() => Number(document.getElementById('chart').dataset.points) >= {first + 3}", timeout=MS
    )
    assert page.locator("#chart polyline").count() == 1
    assert page.text_content("#conn") == "live"
    assert int(page.text_content("#step").split("/")[0]) > 0
    assert page.evaluate("sessionStorage.getItem('hookloop.token')") == job.token
    # the job profiles its callbacks: the cost table lists their handlers
    page.wait_for_selector("#costs", state="visible", timeout=MS)
    page.wait_for_function(
        "() => document.querySelectorAll('#cost-rows tr').length >= 2", timeout=MS
    )
    labels = page.eval_on_selector_all(
        "#cost-rows tr td:first-child", "els => els.map(e => e.textContent)"
    )
    assert "ControlServer" in labels and "JsonLogger" in labels, labels
    shares = page.eval_on_selector_all(
        "#cost-rows tr td:last-child", "els => els.map(e => e.textContent)"
    )
    assert all(s.endswith(" %") for s in shares), shares

    page.click("button[data-command='graceful_stop']")
    page.wait_for_function(
        "() => document.getElementById('message').textContent.includes('graceful_stop filed')",
        timeout=MS,
    )
    job.wait_exit()
    page.wait_for_function(
        "() => document.getElementById('conn').textContent.startsWith('disconnected')", timeout=MS
    )
    assert not any(job.token in url for url in urls), "the token appeared in a URL"
    assert any(url.endswith("/control") for url in urls)
    assert problems == [], problems
