"""One environment for a job's trainers and its operator: ClientConfig's default security and
the examples' flags read the variables ps-admin's options read."""

from __future__ import annotations

import argparse
import typing

import pytest

from ps_offload.admin import cli as admin_cli
from ps_offload.proto.security import ENVIRONMENT, ClientSecurity
from ps_offload.trainer import ClientConfig


def test_the_variables_are_ps_admins():
    envvars = {}
    for name, hint in typing.get_type_hints(admin_cli.main, include_extras=True).items():
        for option in typing.get_args(hint)[1:]:
            if getattr(option, "envvar", None):
                envvars[name] = option.envvar
    assert {name: envvars.get(name) for name in ENVIRONMENT} == ENVIRONMENT


@pytest.fixture
def secured(tmp_path, monkeypatch):
    paths = {name: str(tmp_path / name) for name in ENVIRONMENT}
    paths["server_name"] = "daemons.example"
    for name, variable in ENVIRONMENT.items():
        monkeypatch.setenv(variable, paths[name])
    return paths


def test_a_trainers_default_security_is_the_environments(secured):
    assert ClientConfig().security == ClientSecurity(**secured)


def test_without_the_environment_plaintext_and_no_token(monkeypatch):
    for variable in ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    assert ClientConfig().security == ClientSecurity()


def test_a_scripts_flags_default_to_the_environment_and_win_over_it(secured):
    parser = argparse.ArgumentParser()
    ClientSecurity.add_arguments(parser)
    assert ClientSecurity.from_arguments(parser.parse_args([])) == ClientSecurity(**secured)
    chosen = ClientSecurity.from_arguments(parser.parse_args(["--token-file", "/run/token", "--server-name", "x"]))
    assert (chosen.token_file, chosen.server_name, chosen.ca_file) == ("/run/token", "x", secured["ca_file"])
