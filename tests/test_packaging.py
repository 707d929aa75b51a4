"""The built wheel: what it contains, and that an installed (non-editable) copy works
on its own, command-line tools included."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import deggs
from deggs.numerics.gpu import KERNEL_FILES, SM90_FILES, kernel_source

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
    shutil.copytree(
        ROOT / "deggs", src / "deggs", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
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


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The interpreter with only the installed copy importable: PYTHONPATH is SITE, and the
    working directory is not the repository."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")
    }
    env["PYTHONPATH"] = str(site)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_wheel_holds_the_subpackages_the_kernels_and_the_license(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    for name in {*KERNEL_FILES, *SM90_FILES}:
        assert f"deggs/numerics/kernels/{name}" in names
    for package in ("deggs", "deggs/runtime", "deggs/numerics"):
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


def test_the_installed_copy_is_used_and_finds_its_kernels(site, tmp_path):
    code = (
        "import deggs, deggs.numerics.gpu as gpu; print(deggs.__file__); "
        "src = gpu.kernel_source(); print(len(src)); print('__global__' in src)"
    )
    result = run_installed(site, tmp_path, "-c", code)
    assert result.returncode == 0, result.stderr
    path, length, has_kernel = result.stdout.split()
    assert Path(path).resolve().is_relative_to(site.resolve())
    assert int(length) == len(kernel_source())
    assert has_kernel == "True"


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
