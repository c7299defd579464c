"""The installed release: `ps_offload.__version__`, `ps-daemon --version`, `ps-admin --version`
and the daemon's `ps_build_info` metric. Read from the package's metadata (pyproject.toml's
version), so there is one place to change it; the libraries beside it by their metadata too,
without importing them (torch alone takes seconds)."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

BUILT_WITH = ("torch", "grpcio", "protobuf", "numba")


def release(package: str = "ps-offload") -> str:
    """The installed version of `package`, or "not installed" (a source tree never installed)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def build_info() -> dict[str, str]:
    """ps-offload's release and those of the libraries it runs on, by name."""
    return {"version": release(), "python": platform.python_version(), **{lib: release(lib) for lib in BUILT_WITH}}


def describe(program: str) -> str:
    info = build_info()
    libraries = ", ".join(f"{name} {info[name]}" for name in ("python", *BUILT_WITH))
    return f"{program} {info['version']} ({libraries})"


def version_option(program: str):
    """A typer callback for an eager `--version` flag that prints describe(program) and exits."""

    import typer  # only the CLIs: `import ps_offload` stays light

    def show(value: bool) -> None:
        if value:
            typer.echo(describe(program))
            raise typer.Exit()

    return show
