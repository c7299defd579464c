"""Daemon addresses from a list, PS_DAEMONS or a cluster file; every bad input named."""

from __future__ import annotations

import pytest

from ps_offload.proto.cluster import daemon_addresses


def _file(tmp_path, text):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_explicit_list_wins_over_the_environment(tmp_path):
    env = {"PS_DAEMONS": "a:1,b:2", "PS_CLUSTER_FILE": str(_file(tmp_path, 'daemons = ["c:3"]'))}
    assert daemon_addresses("x:9, y:8", environ=env) == ["x:9", "y:8"]
    assert daemon_addresses(["x:9"], environ=env) == ["x:9"]


def test_environment_list_then_cluster_file(tmp_path):
    path = _file(tmp_path, '# one per node\ndaemons = ["node0:50051", "node1:50051"]\n')
    assert daemon_addresses(environ={"PS_DAEMONS": "a:1,b:2", "PS_CLUSTER_FILE": str(path)}) == ["a:1", "b:2"]
    assert daemon_addresses(environ={"PS_CLUSTER_FILE": str(path)}) == ["node0:50051", "node1:50051"]
    assert daemon_addresses(cluster_file=path, environ={}) == ["node0:50051", "node1:50051"]


def test_nothing_given_names_every_way_to_give_it():
    with pytest.raises(ValueError, match=r"--daemons.*PS_DAEMONS.*PS_CLUSTER_FILE"):
        daemon_addresses(environ={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('daemons = ["a:1"]\nport = 5', r"unknown keys \['port'\]"),
        ("daemons = []", "non-empty list"),
        ('daemons = "a:1"', "non-empty list"),
        ('daemons = ["a:1", "a:1"]', r"names \['a:1'\] more than once"),
        ('daemons = ["a"]', "'a' is not \"HOST:PORT\""),
        ('daemons = [":5"]', "':5' is not"),
        ("daemons = [", "not valid TOML"),
    ],
)
def test_bad_cluster_files_are_refused_with_the_file_named(tmp_path, text, message):
    path = _file(tmp_path, text)
    with pytest.raises(ValueError, match=message) as info:
        daemon_addresses(cluster_file=path, environ={})
    assert str(path) in str(info.value)


def test_missing_cluster_file_and_both_sources_at_once(tmp_path):
    with pytest.raises(ValueError, match="cannot read cluster file .*nope.toml: No such file"):
        daemon_addresses(environ={"PS_CLUSTER_FILE": str(tmp_path / "nope.toml")})
    with pytest.raises(ValueError, match="not both"):
        daemon_addresses("a:1", cluster_file=tmp_path / "c.toml", environ={})
    with pytest.raises(ValueError, match=r"\$PS_DAEMONS: 'a:x' is not"):
        daemon_addresses(environ={"PS_DAEMONS": "a:x"})
