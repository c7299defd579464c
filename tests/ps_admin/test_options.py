"""ps-admin finds the daemons as the trainers do (issue #27): --daemon (or $PS_DAEMON) first,
else $PS_DAEMONS (comma-separated) or the cluster file $PS_CLUSTER_FILE, else the default."""

from __future__ import annotations

import pytest
import typer

from ps_offload.admin.options import DEFAULT_DAEMON, unique_daemons


@pytest.fixture
def environ(monkeypatch):
    for name in ("PS_DAEMONS", "PS_CLUSTER_FILE", "PS_DAEMON"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_named_daemons_win_and_repeat_once(environ):
    environ.setenv("PS_DAEMONS", "a:1,b:2")
    assert unique_daemons(["c:3", "c:3", "d:4"]) == ["c:3", "d:4"]


def test_the_trainers_variables_serve_ps_admin_too(environ, tmp_path):
    assert unique_daemons(None) == [DEFAULT_DAEMON]
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('daemons = ["node0:50051", "node1:50051"]\n')
    environ.setenv("PS_CLUSTER_FILE", str(cluster))
    assert unique_daemons(None) == ["node0:50051", "node1:50051"]
    environ.setenv("PS_DAEMONS", "a:1, b:2")  # the trainer's order of precedence
    assert unique_daemons([]) == ["a:1", "b:2"]


def test_a_bad_list_is_one_line_and_exit_2(environ, capsys):
    environ.setenv("PS_DAEMONS", "a:1,a:1")
    with pytest.raises(typer.Exit) as ended:
        unique_daemons(None)
    assert ended.value.exit_code == 2 and "ps-admin:" in capsys.readouterr().err
