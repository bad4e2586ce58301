"""The psclient CLI on the embedded store: load (.npy / .safetensors), stat, drop."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import psclient
from psclient.cli import main


def test_load_stat_drop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store"
    data = torch.randn(500, 8).half()
    save_file({"a": data, "b": torch.zeros(1)}, str(tmp_path / "emb.safetensors"))
    assert main(["load", url, "--table", "emb", str(tmp_path / "emb.safetensors"),
                 "--tensor", "a", "--batch-size", "128"]) == 0
    out = capsys.readouterr()
    assert "loaded 500 rows into emb" in out.out and "rows/s" in out.out
    assert "500" in out.err  # the tqdm bar
    assert main(["stat", url, "--table", "emb", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["rows"], info["dim"], info["dtype"], info["backend"]) == (500, 8, "float16",
                                                                           "lmdb")
    with psclient.connect(url, table="emb") as ps:
        got, found = ps.lookup(torch.arange(500))
        assert found.all() and torch.equal(got, data)
    assert main(["stat", url, "--table", "emb"]) == 0
    assert "rows" in capsys.readouterr().out
    assert main(["drop", url, "--table", "emb"]) == 0
    assert "dropped table emb (500 rows)" in capsys.readouterr().out
    assert main(["stat", url, "--table", "emb"]) == 1
    assert "TableNotFoundError" in capsys.readouterr().err


def test_load_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store"
    np.save(tmp_path / "rows.npy", np.zeros((10, 4), dtype=np.float32))
    assert main(["load", url, "--table", "x", str(tmp_path / "rows.npy"), "--dim", "4",
                 "--no-progress"]) == 0
    capsys.readouterr()
    # existing table, other dim: a schema error, exit 1, nothing loaded
    assert main(["load", url, "--table", "x", str(tmp_path / "rows.npy"), "--dim", "5"]) == 1
    assert "SchemaMismatchError" in capsys.readouterr().err
    assert main(["load", url, "--table", "x", str(tmp_path / "missing.npy")]) == 1
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["load", url])
