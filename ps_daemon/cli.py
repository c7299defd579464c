"""`ps-daemon serve --config FILE.toml [overrides]`."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ps_offload.daemon import systemd
from ps_offload.daemon.config import ConfigError, load_config, parse_size
from ps_offload.version import version_option

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ps-offload node daemon.")


@app.callback()
def main(
    show_version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=version_option("ps-daemon"), help="Print the version."),
    ] = False,
) -> None:
    """ps-offload node daemon."""


@app.command()
def serve(
    config: Annotated[Optional[Path], typer.Option(help="TOML config file; flags below override it.")] = None,
    listen: Annotated[Optional[str], typer.Option(help="host:port to listen on (port 0: any free port).")] = None,
    data_listen: Annotated[
        Optional[str], typer.Option(help='TCP data plane: "auto" (listen host, free port), "off", or host:port.')
    ] = None,
    state_dir: Annotated[Optional[str], typer.Option(hidden=True, help="No longer read (see --nvme-dir).")] = None,
    nvme_dir: Annotated[
        Optional[str],
        typer.Option(
            help="Persist every committed shard version here (O_DIRECT); recovered on start. Without it: RAM only, "
            "every model is lost when the daemon stops."
        ),
    ] = None,
    create_nvme_dir: Annotated[
        bool, typer.Option("--create-nvme-dir", help="Create --nvme-dir when missing (else a missing one is an error).")
    ] = False,
    nvme_bytes: Annotated[
        Optional[str], typer.Option(help="Most bytes the arena files under --nvme-dir may take, e.g. 2TiB.")
    ] = None,
    shard_bytes: Annotated[Optional[str], typer.Option(help="Default shard size, e.g. 64MiB.")] = None,
    ram_bytes: Annotated[Optional[str], typer.Option(help="RAM tier budget, e.g. 8GiB.")] = None,
    port_file: Annotated[Optional[str], typer.Option(help="Write the bound port here once listening.")] = None,
    log_level: Annotated[Optional[str], typer.Option(help="DEBUG, INFO, WARNING, ERROR.")] = None,
    log_format: Annotated[Optional[str], typer.Option(help='"text" or "json" (one object per line).')] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Serve plaintext on a non-loopback address anyway (no \\[tls] section).")
    ] = False,
) -> None:
    """Serve shards over gRPC until SIGTERM; SIGHUP re-reads --config."""
    try:
        overrides = dict(
            server__listen=listen,
            server__data_listen=data_listen,
            server__port_file=port_file,
            store__nvme_dir=nvme_dir,
            store__create_nvme_dir=True if create_nvme_dir else None,
            store__nvme_bytes=None if nvme_bytes is None else parse_size(nvme_bytes, key="--nvme-bytes"),
            store__shard_bytes=None if shard_bytes is None else parse_size(shard_bytes, key="--shard-bytes"),
            store__ram_bytes=None if ram_bytes is None else parse_size(ram_bytes, key="--ram-bytes"),
            log__level=log_level,
            log__format=log_format,
            server__insecure=True if insecure else None,
        )
        cfg = load_config(config, **overrides)
    except ConfigError as exc:
        typer.echo(f"ps-daemon: {exc}", err=True)
        systemd.notify(f"STATUS=Failed: {exc}")
        raise typer.Exit(2) from None
    _configure_logging(cfg.log.level, cfg.log.format)
    if state_dir is not None:
        logging.getLogger(__name__).warning(
            "--state-dir is no longer read: nothing was ever written there; the daemon's state lives under "
            "--nvme-dir (store.nvme_dir)"
        )
    # systemd's watchdog kills a hung daemon with SIGABRT: the journal then shows where
    # every thread was stuck.
    faulthandler.enable()
    systemd.notify("STATUS=Starting: loading torch and gRPC")
    from ps_offload.daemon.server import run  # imported late: torch and grpc load slowly

    # On SIGHUP the same file and the same flags: flags keep winning over the file.
    reload = None if config is None else lambda: load_config(config, **overrides)
    try:
        code = run(cfg, reload=reload)
    except OSError as exc:
        typer.echo(f"ps-daemon: {exc}", err=True)
        systemd.notify(f"STATUS=Failed: {exc}")
        raise typer.Exit(1) from None
    # run() has drained every call and every committed version is on disk. Skip the
    # interpreter's finalization: with gRPC's pollers, data plane handlers and the
    # prefetcher still alive it can abort in native code (seen once as SIGABRT under load),
    # which would turn a clean stop into a failure for systemd.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _configure_logging(level: str, form: str = "text") -> None:
    """One line per event on stdout, which systemd hands to journald."""
    handler = logging.StreamHandler(sys.stdout)
    if form == "json":
        handler.setFormatter(systemd.JsonFormatter(journal=systemd.stdout_is_journal()))
    elif systemd.stdout_is_journal():
        handler.setFormatter(systemd.JournalFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


if __name__ == "__main__":
    app()
