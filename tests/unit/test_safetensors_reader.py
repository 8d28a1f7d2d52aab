"""fsdp2kit's safetensors reader against safetensors' own: the same refusals of a damaged file, the same values."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fsdp2kit.weights.safetensors import SafetensorsReader, check_file


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g),
        "h": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "s": torch.tensor(3.5),
        "e": torch.zeros(0, 3),
    }


def _damaged(path, how: str):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    if how == "truncated":
        return data[:-3]
    if how == "padded":
        return data + b"\0" * 8
    if how == "overlapping":  # the same length, but one tensor's range starts inside another's
        key = next(k for k in header if k != "__metadata__" and header[k]["data_offsets"][0] > 0)
        header[key]["data_offsets"] = [o - 4 for o in header[key]["data_offsets"]]
    if how == "not json":
        return data[:8] + b"{" * n + data[8 + n :]
    text = json.dumps(header).encode().ljust(n)
    return data[:8] + text + data[8 + n :]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["truncated", "padded", "overlapping", "not json"])
def test_damaged_file_is_refused_naming_it_as_safetensors_does(tmp_path, how):
    good = tmp_path / "good.safetensors"
    save_file(_tensors(), good)
    check_file(good)  # a file safetensors wrote passes
    bad = tmp_path / f"{how.replace(' ', '-')}.safetensors"
    bad.write_bytes(_damaged(good, how))
    with pytest.raises(SafetensorError), safe_open(bad, framework="pt"):
        pass  # safetensors' own reader refuses it ...
    with pytest.raises(ValueError, match=str(bad)) as err:  # ... and so does ours, naming the file
        SafetensorsReader.of([bad])
    if how in ("truncated", "padded"):
        assert how.split()[0] in str(err.value)


@pytest.mark.timeout(60)
def test_rows_columns_and_casts_match_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(_tensors(), path)
    reader = SafetensorsReader.of([path])
    with safe_open(path, framework="pt") as f:
        for key in ("w", "h", "s", "e"):
            assert torch.equal(reader.read(key), f.get_tensor(key)), key
        w = f.get_tensor("w")
        assert torch.equal(reader.read("w", (slice(2, 5), slice(None))), w[2:5])
        assert torch.equal(reader.read("w", (slice(1, 6), slice(1, 4))), w[1:6, 1:4])  # a column block
        assert torch.equal(reader.read("w", (slice(6, 9), slice(None))), w[6:9])  # past the end: what is there
        into = torch.empty(3, 5)
        assert reader.read("w", (slice(4, 7), slice(None)), into=into) is into and torch.equal(into, w[4:7])
        cast = torch.empty(6, 4)  # bf16 on disk into fp32
        assert torch.equal(reader.read("h", into=cast), f.get_tensor("h").float())
    # whole tensors (140 + 48 + 4 + 0), then rows 2:5, the 5 x 3 column block alone, row 6, rows 4:7, h again
    assert reader.bytes == 192 + 60 + 5 * 3 * 4 + 20 + 60 + 48
    reader.close()
