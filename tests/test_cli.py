"""The ``elastic-vllm`` command: instant --help listing every command, one-line errors with the fix (exit 2),
tracebacks only on request, ``bench`` dispatching to benchmarks/ from a source checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_vllm import cli
from elastic_vllm.cli import main

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (
    "fetch-model",
    "serve",
    "train-router",
    "build-data",
    "eval",
    "bench",
    "convert",
    "demo",
    "metrics-exporter",
)


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
    e.pop(cli.DEBUG_ENV, None)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "elastic_vllm.cli", *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300
    )


def assert_one_line_error(r: subprocess.CompletedProcess | str, *needles: str) -> str:
    err = r if isinstance(r, str) else r.stderr
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("elastic-vllm: error: ") and "(fix: " in line and line.endswith(")"), line
    assert "Traceback" not in err
    for n in needles:
        assert n in line, (n, line)
    return line


def test_help_lists_every_command_without_importing_torch():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    for cmd in COMMANDS:
        assert f"    {cmd}" in r.stdout, cmd
    probe = (
        "import sys\nfrom elastic_vllm.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "TORCH False" in out.stdout, out.stdout + out.stderr


def test_every_subcommand_answers_help():
    for cmd in COMMANDS:
        r = run_cli(cmd, "--help")
        assert r.returncode == 0 and r.stdout.startswith(f"usage: elastic-vllm {cmd}"), (cmd, r.stderr[-2000:])


@pytest.mark.parametrize(
    "elastic, needles",
    [
        ('{"window": 0}', ("elastic.window", "greater than or equal to 1", "(got 0)")),
        ('{"windw": 512}', ("elastic.windw", "unknown field")),
        ('{"mode": "FA-XA", "xattn_block": 100}', ("multiple of xattn_stride",)),
        ('{"window": 0', ("invalid JSON",)),
    ],
)
def test_bad_config_is_one_line_with_the_fix_and_exit_2(tmp_path, elastic, needles):
    r = run_cli(
        "train-router",
        "--model",
        str(tmp_path),
        "--data",
        "d.jsonl",
        "--out",
        str(tmp_path / "o"),
        "--elastic",
        elastic,
    )
    assert r.returncode == 2
    assert_one_line_error(r, *needles)
    assert not (tmp_path / "o").exists()  # validated before anything is loaded or written


def test_usage_errors_are_one_line_exit_2():
    for args, needle in ((("bogus",), "invalid choice: 'bogus'"), (("demo", "--force", "x"), "--force")):
        r = run_cli(*args)
        assert r.returncode == 2
        assert_one_line_error(r, needle, "--help")


def test_missing_files_name_the_path(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "o")]) == 2
    assert_one_line_error(capsys.readouterr().err, "no config.json", "authors' model folder")


@pytest.mark.parametrize(
    "exc, needles",
    [
        (FileNotFoundError(2, "No such file or directory", "/data/x.jsonl"), ("/data/x.jsonl: no such file",)),
        (FileNotFoundError(2, "No such file or directory", "vllm"), ("`vllm` not found on PATH", "install.sh")),
        (ModuleNotFoundError("No module named 'vllm'", name="vllm"), ("No module named 'vllm'", "scripts/install.sh")),
        (PermissionError(13, "Permission denied", "/root/x"), ("Permission denied", "folder you can write")),
        (RuntimeError("engine failed"), ("engine failed", "--debug")),
    ],
)
def test_known_errors_exit_2_with_a_fix(monkeypatch, capsys, exc, needles):
    def boom(a):
        raise exc

    monkeypatch.setitem(cli.COMMANDS, "fetch-model", (*cli.COMMANDS["fetch-model"][:2], boom))
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    assert main(["fetch-model"]) == 2
    assert_one_line_error(capsys.readouterr().err, *needles)


def test_router_checkpoint_error_says_how_to_get_a_router(monkeypatch, capsys):
    from elastic_vllm.router.checkpoint import RouterCheckpointError

    def boom(a):
        raise RouterCheckpointError("/r: no router.json")

    monkeypatch.setitem(cli.COMMANDS, "eval", (*cli.COMMANDS["eval"][:2], boom))
    assert main(["eval", "--model", "m", "--out", "o"]) == 2
    assert_one_line_error(capsys.readouterr().err, "/r: no router.json", "elastic-vllm train-router")


def test_long_message_goes_to_a_file_and_unknown_errors_exit_1(monkeypatch, capsys):
    tail = "\n".join(f"server log line {i}" for i in range(50))

    def server_died(a):
        raise RuntimeError(f"vllm serve exited with code 1:\n{tail}")

    monkeypatch.setitem(cli.COMMANDS, "fetch-model", (*cli.COMMANDS["fetch-model"][:2], server_died))
    assert main(["fetch-model"]) == 2
    line = assert_one_line_error(capsys.readouterr().err, "vllm serve exited with code 1:")
    log = Path(line.rsplit(" in ", 1)[1].rstrip(")"))
    assert "server log line 49" in log.read_text()
    log.unlink()

    def bug(a):
        raise TypeError("unsupported operand")

    monkeypatch.setitem(cli.COMMANDS, "fetch-model", (*cli.COMMANDS["fetch-model"][:2], bug))
    assert main(["fetch-model"]) == 1
    line = assert_one_line_error(capsys.readouterr().err, "internal error: TypeError: unsupported operand")
    log = Path(line.rsplit(" in ", 1)[1].rstrip(")"))
    assert "Traceback" in log.read_text()
    log.unlink()


def test_debug_prints_the_traceback(tmp_path):
    args = ("train-router", "--model", str(tmp_path), "--data", "d", "--out", str(tmp_path / "o"), "--elastic", "{")
    for r in (run_cli("--debug", *args), run_cli(*args, env={cli.DEBUG_ENV: "1"})):
        assert r.returncode == 2
        assert "Traceback" in r.stderr and r.stderr.rstrip().splitlines()[-1].startswith("elastic-vllm: error: ")


def test_serve_and_bench_pass_their_arguments_through():
    _, a = cli._parse(["serve", "MODEL", "--port", "8001", "--additional-config", '{"elastic": {}}'])
    assert (a.model, a.vllm_args) == ("MODEL", ["--port", "8001", "--additional-config", '{"elastic": {}}'])
    _, a = cli._parse(["--debug", "serve", "--dtype", "float32"])
    assert (a.model, a.vllm_args, a.debug) == (None, ["--dtype", "float32"], True)
    _, a = cli._parse(["bench", "e2e", "--cpu-dry", "--help"])
    assert (a.benchmark, a.bench_args) == ("e2e", ["--cpu-dry", "--help"])


def test_bench_runs_the_checkout_script():
    r = run_cli("bench", "cpu-serving", "--report", "benchmarks/results/cpu-serving.json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| backend |" in r.stdout
    r = run_cli("bench", "e2e", "--help")
    assert r.returncode == 0 and "--cpu-dry" in r.stdout


def test_bench_outside_a_checkout_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: None)
    assert main(["bench", "kernels"]) == 2
    assert_one_line_error(capsys.readouterr().err, "benchmarks/ not found", "source checkout", "git checkout")


def test_bench_returns_the_scripts_exit_code(tmp_path, monkeypatch):
    d = tmp_path / "benchmarks"
    d.mkdir()
    for script, _ in cli.BENCHMARKS.values():
        (d / script).write_text("import sys, json; print(json.dumps(sys.argv[1:])); sys.exit(3)\n")
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: d)
    assert main(["bench", "kernels", "--quick", "--out", "x.json"]) == 3


def test_benchmarks_dir_is_this_checkout():
    assert cli.benchmarks_dir() == ROOT / "benchmarks"
    assert json.dumps(sorted(cli.BENCHMARKS)) == json.dumps(["accuracy", "cpu-serving", "e2e", "kernels"])


SMOLLM2_CONFIG = ROOT / "tests" / "reliability" / "smollm2_config.json"  # the demo model's shape


@pytest.fixture
def demo_model_config(monkeypatch, tmp_path):
    """The demo model as a folder holding only its config.json (what the router check reads); run_demo must not run."""
    import elastic_vllm.demo
    import elastic_vllm.models

    model = tmp_path / "demo-model"
    model.mkdir()
    (model / "config.json").write_text(SMOLLM2_CONFIG.read_text())
    monkeypatch.setattr(elastic_vllm.models, "fetch_demo_model", lambda *a, **k: model)

    def served(*a, **k):
        raise AssertionError("the demo served with a bad --router")

    monkeypatch.setattr(elastic_vllm.demo, "run_demo", served)
    return model


@pytest.mark.parametrize(
    "make,needles",
    [
        (lambda tmp: "/nonexistent", ["--router /nonexistent: no such folder"]),
        (lambda tmp: tmp / "empty", ["--router ", "/empty: router checkpoint ", "has no router.json"]),
    ],
)
def test_demo_refuses_a_bad_router_before_serving_naming_its_flag(demo_model_config, capsys, tmp_path, make, needles):
    """`elastic-vllm demo --router BAD` used to serve for 10 s, then name the server's elastic.router_path."""
    router = make(tmp_path)
    if router != "/nonexistent":
        router.mkdir()
    assert main(["demo", "--router", str(router)]) == 2
    line = assert_one_line_error(capsys.readouterr().err, *needles, "leave --router out for the shipped one")
    assert "router_path" not in line, line


def test_demo_accepts_the_shipped_router_as_its_router(demo_model_config, monkeypatch):
    import elastic_vllm.demo

    monkeypatch.setattr(elastic_vllm.demo, "run_demo", lambda *a: [{"omega_msr": 0.5}])
    assert main(["demo", "--router", str(ROOT / "router_weights" / "smollm2-135m-instruct")]) == 0


def test_importing_the_package_does_not_import_pydantic():
    probe = "import sys, elastic_vllm\nprint('PYDANTIC', 'pydantic' in sys.modules)\nelastic_vllm.ElasticConfig()"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "PYDANTIC False" in out.stdout and out.returncode == 0, out.stdout + out.stderr
