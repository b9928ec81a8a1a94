"""``--host-transport`` and ``TRAINMESH_HOST_TRANSPORT``: the flag reaches the ranks, a bad value stops the
command in one line."""

import os

from trainmesh.app import cli
from trainmesh.distributed.shm import TRANSPORT_ENV


def test_the_flag_sets_the_variable_and_a_bad_value_is_refused_in_one_line(monkeypatch, capsys):
    """``--host-transport off`` reaches the ranks through the environment the launcher hands them; a value of
    the variable that is neither auto nor off stops the command before any rank starts."""
    monkeypatch.setenv(TRANSPORT_ENV, "auto")
    cli.checked_config(cli._parser().parse_args(["train", "--host-transport", "off"]))
    assert os.environ[TRANSPORT_ENV] == "off"
    monkeypatch.setenv(TRANSPORT_ENV, "shm")
    assert cli.main(["train", "--steps", "1"]) == 2
    assert capsys.readouterr().err == (f"trainmesh: error: {TRANSPORT_ENV}='shm' is not one of auto, off; set it "
                                       f"to auto (shared memory between one host's ranks) or off (everything "
                                       f"through torch.distributed)\n")
