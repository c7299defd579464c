"""Unit tests for ps_daemon/config.py: TOML loading, strictness, sizes, overrides, validation."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

import ps_offload.daemon.config as config_mod
from ps_offload.daemon.config import (
    ConfigError,
    DaemonConfig,
    LogConfig,
    ServerConfig,
    StoreConfig,
    load_config,
    parse_size,
    validate,
)

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def write_toml(tmp_path: Path):
    def write(text: str, name: str = "daemon.toml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


# -- defaults and a full file ---------------------------------------------------------------


def test_defaults_load_without_a_file():
    config = load_config(None)
    assert config == DaemonConfig()
    assert config.server == ServerConfig()
    assert config.store == StoreConfig()
    assert config.log == LogConfig()
    # Spot-check a few documented defaults so a silent change of a default is noticed.
    assert config.server.listen == "127.0.0.1:50051"
    assert config.server.max_workers == 32
    assert config.server.max_message_bytes == 8 * MiB
    assert config.store.ram_bytes == 8 * GiB
    assert config.store.shard_bytes == 64 * MiB
    assert config.log.level == "INFO"


def test_empty_file_gives_defaults(write_toml):
    assert load_config(write_toml("")) == DaemonConfig()


FULL_TOML = """
[server]
listen = "0.0.0.0:6000"
insecure = true
port_file = "/tmp/ps.port"
max_workers = 7
max_message_bytes = "16MiB"
grace_seconds = 2.5
max_pull_wait_seconds = 12

[store]
nvme_dir = "/srv/ps"
ram_bytes = "3 GiB"
shard_bytes = 1048576

[log]
level = "DEBUG"
"""


def test_full_file_lands_in_the_right_dataclasses(write_toml):
    config = load_config(write_toml(FULL_TOML))
    assert config.server == ServerConfig(
        listen="0.0.0.0:6000",
        insecure=True,
        port_file="/tmp/ps.port",
        max_workers=7,
        max_message_bytes=16 * MiB,
        grace_seconds=2.5,
        max_pull_wait_seconds=12.0,
    )
    assert config.store == StoreConfig(nvme_dir="/srv/ps", ram_bytes=3 * GiB, shard_bytes=MiB)
    assert config.log == LogConfig(level="DEBUG")
    # An integer given for a float option becomes a float.
    assert isinstance(config.server.max_pull_wait_seconds, float)


def test_load_config_accepts_str_path(write_toml):
    path = write_toml('[log]\nlevel = "WARNING"\n')
    assert load_config(str(path)).log.level == "WARNING"


# -- the set of options is frozen ------------------------------------------------------------


def _dotted_keys(obj, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += _dotted_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


# Every option of DaemonConfig, as a dotted key. ADDING, REMOVING OR RENAMING AN OPTION MUST
# UPDATE THE DOCS (the config table of docs/configuration.md) AND THIS LIST, in the same
# change, so that options cannot drift away from their documentation silently. A rename also
# needs an entry in ps_offload.daemon.config.RENAMED_KEYS so existing config files keep working.
KNOWN_OPTIONS = [
    "server.listen",
    "server.data_listen",
    "server.port_file",
    "server.max_data_connections",
    "server.max_data_connections_per_client",
    "server.local_pool_bytes",
    "server.data_workers",
    "server.data_idle_seconds",
    "server.data_stall_seconds",
    "server.max_workers",
    "server.max_calls_per_client",
    "server.max_waiting_pulls",
    "server.max_waiting_pulls_per_client",
    "server.max_message_bytes",
    "server.grace_seconds",
    "server.max_pull_wait_seconds",
    "server.health_listen",
    "server.health_check_seconds",
    "server.local_group",
    "server.cpus",
    "server.scheduling",
    "server.insecure",
    "store.ram_bytes",
    "store.shard_bytes",
    "store.nvme_dir",
    "store.create_nvme_dir",
    "store.nvme_bytes",
    "store.nvme_spare_slots",
    "store.nvme_floor_seconds",
    "store.fsync",
    "store.io_threads",
    "store.io_read_threads",
    "store.optimizer_threads",
    "store.io_block_bytes",
    "store.prefetch_depth",
    "store.allow_nonfinite_pushes",
    "store.speculation_bytes",
    "store.max_models",
    "store.max_shards_per_model",
    "tls.cert_file",
    "tls.key_file",
    "tls.client_ca_file",
    "auth.token_file",
    "auth.require_token",
    "metrics.listen",
    "metrics.port_file",
    "log.level",
    "log.format",
]


def test_option_set_is_frozen():
    assert _dotted_keys(DaemonConfig()) == KNOWN_OPTIONS, (
        "DaemonConfig's options changed: update the config table of docs/configuration.md "
        "and KNOWN_OPTIONS in this test (and RENAMED_KEYS for a rename)"
    )


def test_every_option_can_be_set_from_a_file(write_toml, tmp_path):
    """Each frozen option is reachable through the loader under its dotted key."""
    pem = tmp_path / "x.pem"
    pem.write_text("not checked until the server starts")
    samples = {
        "server.listen": ('"127.0.0.3:1"', "127.0.0.3:1"),
        "server.data_listen": ('"off"', "off"),
        "server.port_file": ('"p"', "p"),
        "server.max_data_connections": ("8", 8),
        "server.max_data_connections_per_client": ("4", 4),
        "server.data_workers": ("2", 2),
        "server.data_idle_seconds": ("2.5", 2.5),
        "server.data_stall_seconds": ("7.5", 7.5),
        "server.max_workers": ("3", 3),
        "server.max_calls_per_client": ("2", 2),
        "server.max_waiting_pulls": ("1", 1),
        "server.max_waiting_pulls_per_client": ("1", 1),
        "server.max_message_bytes": ('"1MiB"', MiB),
        "server.local_pool_bytes": ('"64MiB"', 64 * MiB),
        "server.grace_seconds": ("1.5", 1.5),
        "server.max_pull_wait_seconds": ("4.0", 4.0),
        "server.health_listen": ('"127.0.0.1:50053"', "127.0.0.1:50053"),
        "server.health_check_seconds": ("5.0", 5.0),
        "server.local_group": ('"root"', "root"),
        "server.cpus": ('"0-1,3"', "0-1,3"),
        "server.scheduling": ('"idle"', "idle"),
        "server.insecure": ("true", True),
        "store.ram_bytes": ('"2GiB"', 2 * GiB),
        "store.shard_bytes": ("8192", 8192),
        "store.nvme_dir": ('"/nvme"', "/nvme"),
        "store.create_nvme_dir": ("true", True),
        "store.nvme_bytes": ('"2TiB"', 2 << 40),
        "store.nvme_spare_slots": ("2", 2),
        "store.nvme_floor_seconds": ("0.25", 0.25),
        "store.fsync": ("false", False),
        "store.io_threads": ("8", 8),
        "store.io_read_threads": ("16", 16),
        "store.optimizer_threads": ("3", 3),
        "store.io_block_bytes": ('"4MiB"', 4 * MiB),
        "store.prefetch_depth": ("0", 0),
        "store.allow_nonfinite_pushes": ("true", True),
        "store.speculation_bytes": ('"16GiB"', 16 << 30),
        "store.max_models": ("3", 3),
        "store.max_shards_per_model": ("100", 100),
        "tls.cert_file": (f'"{pem}"', str(pem)),
        "tls.key_file": (f'"{pem}"', str(pem)),
        "tls.client_ca_file": (f'"{pem}"', str(pem)),
        "auth.token_file": (f'"{pem}"', str(pem)),
        "auth.require_token": ('"all"', "all"),
        "metrics.listen": ('"127.0.0.1:9100"', "127.0.0.1:9100"),
        "metrics.port_file": ('"m"', "m"),
        "log.level": ('"ERROR"', "ERROR"),
        "log.format": ('"json"', "json"),
    }
    assert sorted(samples) == sorted(KNOWN_OPTIONS)
    for dotted, (toml_value, expected) in samples.items():
        section, key = dotted.split(".")
        # TLS keys come in pairs: the others of the section are set as well
        extra = "".join(f'{k} = "{pem}"\n' for k in ("cert_file", "key_file") if section == "tls" and k != key)
        config = load_config(write_toml(f"[{section}]\n{key} = {toml_value}\n{extra}"))
        assert getattr(getattr(config, section), key) == expected, dotted


# -- strictness: unknown keys and sections ---------------------------------------------------


def test_unknown_key_names_dotted_key_and_suggests_close_match(write_toml):
    with pytest.raises(ConfigError) as info:
        load_config(write_toml("[store]\nram_byte = 5\n"))
    message = str(info.value)
    assert "store.ram_byte" in message
    assert "did you mean" in message
    assert "ram_bytes" in message


def test_unknown_key_suggestion_is_the_quoted_dotted_key(write_toml):
    with pytest.raises(ConfigError) as info:
        load_config(write_toml("[store]\nram_byte = 5\n"))
    assert "did you mean 'store.ram_bytes'?" in str(info.value)


def test_unknown_key_without_close_match_lists_known_keys(write_toml):
    with pytest.raises(ConfigError) as info:
        load_config(write_toml("[server]\nzzzzzz = 1\n"))
    message = str(info.value)
    assert "server.zzzzzz" in message
    assert "did you mean" not in message
    for key in ("listen", "max_workers", "grace_seconds"):
        assert key in message


def test_unknown_section_rejected(write_toml):
    with pytest.raises(ConfigError) as info:
        load_config(write_toml("[stroe]\nram_bytes = 5\n"))
    message = str(info.value)
    assert "stroe" in message
    assert "store" in message  # the close match is suggested


def test_unknown_top_level_scalar_rejected(write_toml):
    with pytest.raises(ConfigError, match="verbose"):
        load_config(write_toml("verbose = true\n"))


def test_nested_table_inside_section_rejected(write_toml):
    with pytest.raises(ConfigError, match=r"server\.extra"):
        load_config(write_toml("[server.extra]\nx = 1\n"))


def test_section_given_as_scalar_rejected(write_toml):
    with pytest.raises(ConfigError, match="store"):
        load_config(write_toml("store = 5\n"))


# -- types -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "dotted"),
    [
        ('[server]\nmax_workers = "32"\n', "server.max_workers"),  # string for int
        ("[server]\nmax_workers = true\n", "server.max_workers"),  # bool for int
        ("[server]\nmax_workers = 3.0\n", "server.max_workers"),  # float for int
        ("[server]\nlisten = 50051\n", "server.listen"),  # int for str
        ('[server]\ngrace_seconds = "30"\n', "server.grace_seconds"),  # string for float
        ("[server]\ngrace_seconds = false\n", "server.grace_seconds"),  # bool for float
        ("[store]\nram_bytes = true\n", "store.ram_bytes"),  # bool for size
        ("[store]\nram_bytes = 1.5\n", "store.ram_bytes"),  # float for size
        ("[store]\nshard_bytes = [4096]\n", "store.shard_bytes"),  # array for size
        ("[log]\nlevel = 10\n", "log.level"),  # int for str
    ],
)
def test_wrong_types_rejected(write_toml, toml, dotted):
    with pytest.raises(ConfigError) as info:
        load_config(write_toml(toml))
    message = str(info.value)
    assert dotted in message
    # Refused as a type error by the loader, not by a later range check in validate() (which
    # would also catch `max_workers = true`, as True < 2, for the wrong reason).
    assert "expected" in message


# -- sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        (0, 0),
        ("4096", 4096),
        ("64MiB", 64 * MiB),
        ("8 GiB", 8 * GiB),
        ("  2KiB ", 2048),
        ("3 mib", 3 * MiB),  # units are case-insensitive
        ("1TiB", 1 << 40),
        ("512B", 512),
    ],
)
def test_parse_size_accepts(value, expected):
    assert parse_size(value, key="store.ram_bytes") == expected


@pytest.mark.parametrize("value", ["12 parsecs", -1, "-1", "", "MiB", "1.5GiB", "64M", "64 MB", True, 1.0, None])
def test_parse_size_rejects(value):
    with pytest.raises(ConfigError) as info:
        parse_size(value, key="store.ram_bytes")
    assert "store.ram_bytes" in str(info.value)


@pytest.mark.parametrize(
    ("toml_value", "expected"),
    [('"64MiB"', 64 * MiB), ('"8 GiB"', 8 * GiB), ("4096", 4096), ('"4096"', 4096)],
)
def test_sizes_in_file(write_toml, toml_value, expected):
    assert load_config(write_toml(f"[store]\nram_bytes = {toml_value}\n")).store.ram_bytes == expected


@pytest.mark.parametrize("toml_value", ['"12 parsecs"', "-1"])
def test_bad_sizes_in_file_rejected(write_toml, toml_value):
    with pytest.raises(ConfigError, match=r"store\.ram_bytes"):
        load_config(write_toml(f"[store]\nram_bytes = {toml_value}\n"))


# -- overrides -------------------------------------------------------------------------------


def test_overrides_win_over_the_file(write_toml):
    path = write_toml(FULL_TOML)
    config = load_config(path, server__listen="127.0.0.1:0", store__ram_bytes="1GiB", log__level="ERROR")
    assert config.server.listen == "127.0.0.1:0"
    assert config.store.ram_bytes == GiB
    assert config.log.level == "ERROR"
    # Options not overridden keep the file's values.
    assert config.server.max_workers == 7
    assert config.store.nvme_dir == "/srv/ps"


def test_none_override_keeps_the_file_value(write_toml):
    config = load_config(write_toml(FULL_TOML), server__listen=None, store__nvme_dir=None)
    assert config.server.listen == "0.0.0.0:6000"
    assert config.store.nvme_dir == "/srv/ps"


def test_overrides_without_a_file():
    config = load_config(None, store__nvme_dir="/tmp/x", server__max_workers=4)
    assert config.store.nvme_dir == "/tmp/x"
    assert config.server.max_workers == 4
    assert config.server.listen == ServerConfig().listen


def test_overrides_are_checked_like_the_file():
    with pytest.raises(ConfigError, match=r"server\.max_workers"):
        load_config(None, server__max_workers="many")
    with pytest.raises(ConfigError, match=r"server\.lisen"):
        load_config(None, server__lisen="127.0.0.1:0")


# -- validate() ------------------------------------------------------------------------------


def test_validate_returns_a_good_config_unchanged():
    config = DaemonConfig()
    assert validate(config) is config


@pytest.mark.parametrize("shard_bytes", [0, 1, 4095])
def test_validate_refuses_small_shards(shard_bytes):
    config = DaemonConfig(store=StoreConfig(shard_bytes=shard_bytes))
    with pytest.raises(ConfigError, match=r"store\.shard_bytes"):
        validate(config)


def test_validate_accepts_minimum_shard():
    assert validate(DaemonConfig(store=StoreConfig(shard_bytes=4096))).store.shard_bytes == 4096


def test_load_config_runs_validate(write_toml):
    with pytest.raises(ConfigError, match=r"store\.shard_bytes"):
        load_config(write_toml("[store]\nshard_bytes = 4095\n"))
    with pytest.raises(ConfigError, match=r"log\.level"):
        load_config(None, log__level="LOUD")


@pytest.mark.parametrize("level", ["LOUD", "", "verbose"])
def test_validate_refuses_unknown_log_level(level):
    with pytest.raises(ConfigError, match=r"log\.level"):
        validate(DaemonConfig(log=LogConfig(level=level)))


@pytest.mark.parametrize("level", ["DEBUG", "info", "Warning", "ERROR", "CRITICAL"])
def test_validate_accepts_known_log_levels(level):
    assert validate(DaemonConfig(log=LogConfig(level=level))).log.level == level


def test_validate_refuses_too_few_workers_and_tiny_messages():
    with pytest.raises(ConfigError, match=r"server\.max_workers"):
        validate(DaemonConfig(server=ServerConfig(max_workers=1)))
    with pytest.raises(ConfigError, match=r"server\.max_message_bytes"):
        validate(DaemonConfig(server=ServerConfig(max_message_bytes=(64 << 10) - 1)))
    assert validate(DaemonConfig(server=ServerConfig(max_workers=2, max_message_bytes=64 << 10)))


# -- file errors -----------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path):
    path = tmp_path / "nope" / "daemon.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_invalid_toml_names_the_path(write_toml):
    path = write_toml("[server\nlisten = \n", name="broken.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "TOML" in str(info.value)


# -- renamed keys ----------------------------------------------------------------------------


def test_renamed_key_lands_in_new_field_with_a_warning(write_toml, monkeypatch, caplog):
    monkeypatch.setitem(config_mod.RENAMED_KEYS, "store.ram_budget", "store.ram_bytes")
    path = write_toml('[store]\nram_budget = "2GiB"\nshard_bytes = 8192\n')
    with caplog.at_level(logging.WARNING, logger="ps_offload.daemon.config"):
        config = load_config(path)
    assert config.store.ram_bytes == 2 * GiB  # parsed as a size under its new name
    assert config.store.shard_bytes == 8192
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "ps_offload.daemon.config"]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "store.ram_budget" in message
    assert "store.ram_bytes" in message


def test_new_key_gives_no_rename_warning(write_toml, monkeypatch, caplog):
    monkeypatch.setitem(config_mod.RENAMED_KEYS, "store.ram_budget", "store.ram_bytes")
    with caplog.at_level(logging.WARNING, logger="ps_offload.daemon.config"):
        config = load_config(write_toml('[store]\nram_bytes = "1GiB"\n'))
    assert config.store.ram_bytes == GiB
    assert not [r for r in caplog.records if r.name == "ps_offload.daemon.config"]


def test_old_key_is_unknown_without_the_rename_entry(write_toml):
    assert "store.ram_budget" not in config_mod.RENAMED_KEYS
    with pytest.raises(ConfigError, match=r"store\.ram_budget"):
        load_config(write_toml('[store]\nram_budget = "2GiB"\n'))


def test_unreadable_config_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)  # a directory
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)


@pytest.mark.parametrize("value", ["auto", "off", "127.0.0.2:7000", "[::1]:0"])
def test_data_listen_accepts_auto_off_and_addresses(write_toml, value):
    assert load_config(write_toml(f'[server]\ndata_listen = "{value}"\n')).server.data_listen == value


@pytest.mark.parametrize(
    "server",
    ['listen = "0.0.0.0:6000"', 'listen = "[::]:6000"', 'listen = "node3:6000"', 'data_listen = "10.0.0.5:7000"'],
)
def test_plaintext_beyond_loopback_is_refused_unless_insecure_or_tls(write_toml, tmp_path, server):
    """Secure by default: an address other than loopback without [tls] (its traffic, and a
    token, in clear) starts only with server.insecure (--insecure); TLS or loopback need none."""
    with pytest.raises(ConfigError, match=r"is not a loopback address and \[tls\] is not set.*--insecure"):
        load_config(write_toml(f"[server]\n{server}\n"))
    assert load_config(write_toml(f"[server]\n{server}\ninsecure = true\n")).server.insecure
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("cert")
    key.write_text("key")
    tls = f'[tls]\ncert_file = "{cert}"\nkey_file = "{key}"\n'
    assert not load_config(write_toml(f"[server]\n{server}\n{tls}")).server.insecure
    for loopback in ("127.0.0.1:6000", "[::1]:6000", "localhost:6000"):
        load_config(write_toml(f'[server]\nlisten = "{loopback}"\n'))


def test_data_listen_rejects_other_values(write_toml):
    with pytest.raises(ConfigError, match="data_listen"):
        load_config(write_toml('[server]\ndata_listen = "yes"\n'))


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[server]\nlisten = "127.0.0.1:99999"\n', r"server.listen: port 99999 is out of range \(0-65535"),
        ('[server]\nlisten = "nonsense"\n', "server.listen must be host:port"),
        ('[server]\nlisten = ":50051"\n', "server.listen must be host:port"),
        ('[server]\nlisten = "127.0.0.1:"\n', "server.listen must be host:port"),
        ('[server]\ndata_listen = "127.0.0.1:70000"\n', "server.data_listen: port 70000 is out of range"),
        ('[server]\ndata_listen = "127.0.0.1:x"\n', 'server.data_listen must be "auto", "off" or host:port'),
        ('[metrics]\nlisten = "127.0.0.1:123456"\n', "metrics.listen must be empty"),
        ('[metrics]\nlisten = "127.0.0.1:65536"\n', "metrics.listen: port 65536 is out of range"),
        (
            '[server]\nlisten = "127.0.0.1:6000"\ndata_listen = "127.0.0.1:6000"\n',
            "server.listen and server.data_listen both ask for port 6000",
        ),
        (
            '[server]\nlisten = "127.0.0.1:6000"\n[metrics]\nlisten = "127.0.0.1:6000"\n',
            "server.listen and metrics.listen both ask for port 6000",
        ),
    ],
)
def test_every_address_is_checked_naming_its_key(write_toml, toml, message):
    """A port past 65535 once listened on a wrapped port, and "nonsense" ended in a traceback;
    both are config errors now, naming the key."""
    with pytest.raises(ConfigError, match=message):
        load_config(write_toml(toml))


def test_a_removed_key_loads_with_a_warning(write_toml, caplog):
    """store.state_dir was never written to: old configs still start, told to drop it."""
    config = load_config(write_toml('[store]\nstate_dir = "/var/lib/ps-daemon"\n'))
    assert config.store == StoreConfig()
    assert "store.state_dir' is no longer read" in caplog.text and "store.nvme_dir" in caplog.text


def test_bool_options_take_only_booleans(write_toml):
    with pytest.raises(ConfigError, match="store.fsync: expected true or false"):
        load_config(write_toml('[store]\nfsync = "yes"\n'))


def test_no_spare_slot_is_refused_with_why(write_toml):
    with pytest.raises(ConfigError, match="store.nvme_spare_slots must be at least 1"):
        load_config(write_toml("[store]\nnvme_spare_slots = 0\n"))


@pytest.mark.parametrize("value", ["0", "-1.0", "nan", "inf", "3601"])
def test_floor_interval_out_of_range_is_refused_with_why(write_toml, value):
    with pytest.raises(ConfigError, match="store.nvme_floor_seconds must be above 0 and at most 3600"):
        load_config(write_toml(f"[store]\nnvme_floor_seconds = {value}\n"))


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[tls]\ncert_file = "{pem}"\n', "tls.cert_file and tls.key_file go together"),
        ('[tls]\nclient_ca_file = "{pem}"\n', "needs tls.cert_file and tls.key_file too"),
        ('[tls]\ncert_file = "{pem}"\nkey_file = "/nonexistent.pem"\n', "tls.key_file: /nonexistent.pem is not"),
        ('[auth]\ntoken_file = "/nonexistent"\n', "auth.token_file: /nonexistent is not a readable file"),
        ('[auth]\nrequire_token = "some"\n', 'require_token must be "admin" or "all"'),
        ('[metrics]\nlisten = "9100"\n', "metrics.listen must be empty"),
    ],
)
def test_tls_auth_and_metrics_settings_that_cannot_work_are_refused(write_toml, tmp_path, toml, message):
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(write_toml(toml.format(pem=pem)))


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("max_data_connections = 0", "server.data_workers must each be at least 1"),
        ("max_data_connections_per_client = 0", "server.data_workers must each be at least 1"),
        ("data_workers = 0", "server.data_workers must each be at least 1"),
        ("data_idle_seconds = 0.0", "data_stall_seconds must be above 0"),
        ("data_stall_seconds = -1.0", "data_stall_seconds must be above 0"),
        ("max_waiting_pulls_per_client = -1", "max_waiting_pulls_per_client must be at least 0"),
    ],
)
def test_data_plane_limits_that_cannot_work_are_refused(write_toml, toml, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_toml(f"[server]\n{toml}\n"))


def test_a_local_group_this_host_does_not_know_is_refused(tmp_path):
    path = tmp_path / "daemon.toml"
    path.write_text('[server]\nlocal_group = "no-such-group-ps"\n')
    with pytest.raises(ConfigError, match="server.local_group: no group named 'no-such-group-ps' on this host"):
        load_config(path)
