"""The built wheel: what it contains, and that an installed (non-editable) copy works
on its own, command-line tools included."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import deggs
from deggs.numerics.gpu.compile import kernel_files, program_source

pytestmark = pytest.mark.slow  # real processes, builds and installs

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [
    "coordinator",
    "worker",
    "prepare",
    "generate",
    "export",
    "plot",
    "print-arch",
    "secret",
]
FUNCTIONS = {
    "coordinator": "coordinator_main",
    "worker": "worker_main",
    "prepare": "prepare_main",
    "generate": "generate_main",
    "export": "export_main",
    "plot": "plot_main",
    "print-arch": "print_arch_main",
    "secret": "secret_main",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (so no build/ or egg-info lands in the tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for folder in ("deggs", "kernels"):  # kernels/: the CUDA sources, as deggs.kernels
        shutil.copytree(
            ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    wheels = list(out.glob("deggs-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    """The wheel installed, non-editable, into a directory of its own."""
    target = tmp_path_factory.mktemp("install") / "site"
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return target


def installed_env(site: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")
    }
    env["PYTHONPATH"] = str(site)
    return env


def run_installed(site: Path, cwd: Path, *args: str, timeout=300) -> subprocess.CompletedProcess:
    """The interpreter with only the installed copy importable: PYTHONPATH is SITE, and the
    working directory is not the repository."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=installed_env(site),
        capture_output=True,
        text=True,
        timeout=timeout,
        umask=0o022,
    )


def test_the_wheel_holds_the_subpackages_the_kernels_and_the_license(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    shipped = kernel_files()
    assert {"common.cuh", "forward.cu", "head_loss_sm90.cu"} <= set(shipped)
    for name in shipped:  # one copy each, inside the package
        assert f"deggs/kernels/{name}" in names
        assert sum(n.endswith(f"/{name}") for n in names) == 1, name
    assert "deggs/kernels/README.md" in names
    for package in ("deggs", "deggs/runtime", "deggs/numerics", "deggs/numerics/gpu"):
        expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / package).glob("*.py")}
        assert expected and expected <= names, sorted(expected - names)
    dist_info = f"deggs-{deggs.__version__}.dist-info"
    assert any(n.startswith(dist_info + "/") and n.endswith("/LICENSE") for n in names), sorted(
        names
    )
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    assert "License-Expression: MIT" in metadata
    assert "deggs = deggs.cli:main" in entry_points
    for command in COMMANDS:
        assert f"deggs-{command} = deggs.cli:{FUNCTIONS[command]}" in entry_points


def test_the_packaged_default_config_is_the_top_level_config_toml(wheel):
    """One file: config.toml at the top links to the package's default.toml, and the wheel
    carries it (and small.toml) as regular files."""
    assert (ROOT / "config.toml").resolve() == (ROOT / "deggs" / "configs" / "default.toml")
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("deggs/configs/default.toml") == (ROOT / "config.toml").read_bytes()
        assert zf.read("deggs/configs/small.toml").startswith(b"# small:")


def test_the_installed_copy_is_used_and_finds_its_kernels(site, tmp_path):
    code = (
        "import deggs; from deggs.numerics.gpu import compile as c; print(deggs.__file__); "
        "print(c.kernel_folder().joinpath('common.cuh')); "
        "print(c.kernel_files()); print(len(c.program_source('main'))); "
        "print(len(c.program_source('sm90a')))"
    )
    result = run_installed(site, tmp_path, "-c", code)
    assert result.returncode == 0, result.stderr
    path, folder, files, main, sm90a = result.stdout.splitlines()
    assert Path(path).resolve().is_relative_to(site.resolve())
    assert Path(folder).resolve() == (site / "deggs" / "kernels" / "common.cuh").resolve()
    assert files == str(kernel_files())
    assert int(main) == len(program_source("main"))
    assert int(sm90a) == len(program_source("sm90a"))


@pytest.mark.parametrize("flag", ["--help", "-h", "--version"])
def test_every_command_of_the_installed_copy_answers_help_and_version(site, tmp_path, flag):
    result = run_installed(site, tmp_path, "-m", "deggs", flag)
    assert result.returncode == 0, result.stderr
    if flag == "--version":
        assert result.stdout.strip() == f"deggs, version {deggs.__version__}"
    else:
        assert "Usage: python -m deggs" in result.stdout
        assert all(command in result.stdout for command in COMMANDS)
    for command in COMMANDS:
        # as a subcommand of the group (what `deggs COMMAND` runs) ...
        result = run_installed(site, tmp_path, "-m", "deggs", command, flag)
        assert result.returncode == 0, (command, result.stderr)
        # ... and as the function behind the deggs-COMMAND script
        call = (
            f"from deggs.cli import {FUNCTIONS[command]} as c; "
            f"c([{flag!r}], prog_name='deggs-{command}')"
        )
        direct = run_installed(site, tmp_path, "-c", call)
        assert direct.returncode == 0, (command, direct.stderr)
        if flag == "--version":
            assert result.stdout.strip() == f"deggs-{command}, version {deggs.__version__}"
            assert direct.stdout == result.stdout
        else:
            assert f"Usage: python -m deggs {command} [OPTIONS]" in result.stdout
            assert f"Usage: deggs-{command} [OPTIONS]" in direct.stdout
            assert "-h, --help" in result.stdout and "--version" in result.stdout


@pytest.mark.parametrize("command", ["coordinator", "worker", "prepare"])
def test_help_does_not_load_the_numerics(site, tmp_path, command):
    """`deggs COMMAND --help` must stay fast: numba (seconds to import) stays unloaded."""
    code = (
        "import sys\nfrom deggs.cli import main\n"
        f"try:\n    main([{command!r}, '--help'], prog_name='deggs', standalone_mode=False)\n"
        "finally:\n    print('numba loaded:', 'numba' in sys.modules)\n"
    )
    result = run_installed(site, tmp_path, "-c", code)
    assert result.returncode == 0, result.stderr
    assert f"Usage: deggs {command}" in result.stdout
    assert "numba loaded: False" in result.stdout, "importing deggs.cli for --help loads numba"


def readable_by_all(root: Path) -> list[str]:
    """Files and directories under ROOT that others cannot read."""
    return [
        f"{path.relative_to(root)} {stat.filemode(path.stat().st_mode)}"
        for path in [root, *root.rglob("*")]
        if not path.stat().st_mode & stat.S_IROTH
    ]


def own_text(size: int) -> str:
    """A few hundred KB of text a user might have: Python's own library sources."""
    parts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= size:
            break
    return "\n".join(parts)


def test_a_newcomer_trains_on_own_text_from_a_regular_install(site, tmp_path):
    """The README's by-hand path, as a user takes it: an empty directory outside the
    checkout, umask 022, their own text with --vocab-size 512, the coordinator on the
    packaged small config taking the vocabulary from the data, a worker with no config,
    three steps, an export, and a sample of it from another directory."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "my.txt").write_text(own_text(300_000))
    prepared = run_installed(
        site, work, "-m", "deggs", "prepare", "my.txt", "--vocab-size", "512", "--out", "data"
    )
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    meta = json.loads((work / "data" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["token_dtype"]) == (512, "uint32")

    coordinator = subprocess.Popen(
        [sys.executable, "-m", "deggs", "coordinator", "--config", "small", "--data-dir", "data"]
        + ["--port", "0", "--save-dir", "run", "--max-steps", "3"],
        cwd=work,
        env=installed_env(site),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        umask=0o022,
    )
    try:
        seen = []
        for line in coordinator.stdout:
            seen.append(line)
            if match := re.search(r"listening on [0-9.]+:(\d+)", line):
                break
        assert match, "".join(seen)
        assert any("vocab_size 512 (uint32 tokens) from data/meta.json" in x for x in seen), seen
        worker = run_installed(
            site,
            work,
            *("-m", "deggs", "worker", "127.0.0.1", "--port", match.group(1)),
            *("--data-dir", "data", "--backend", "cpu", "--threads", "2"),
            timeout=900,
        )
        assert worker.returncode == 0, worker.stdout + worker.stderr
        assert "using the coordinator's config" in worker.stdout
        assert re.search(r"^\d\d:\d\d:\d\d \[worker\]", worker.stdout, re.M)  # a time a line
        rest, _ = coordinator.communicate(timeout=120)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.communicate()
    assert coordinator.returncode == 0, "".join(seen) + rest
    assert "Train: " in rest and " bits/token" in rest, rest

    records = [
        json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["bits_per_token"] > 0 and r["bits_per_byte"] > 0 for r in records), records

    exported = run_installed(
        site,
        work,
        *("-m", "deggs", "export", "--load-dir", "run", "--out", "model.safetensors"),
        *("--data-dir", "data", "--backend", "cpu"),
        timeout=600,
    )
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert readable_by_all(work) == []

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sample = run_installed(
        site,
        elsewhere,
        *("-m", "deggs", "generate", "--model", str(work / "model.safetensors")),
        *("--prompt", "def main(", "--tokens", "16", "--backend", "cpu"),
        timeout=600,
    )
    assert sample.returncode == 0, sample.stdout + sample.stderr
    assert "step 3:" in sample.stdout and "def main( >>> " in sample.stdout, sample.stdout
