"""The public checkpoint reader: one resolve, each manifest node read once."""

from collections import Counter

import pytest
import torch

import cas
from cas.store.reader import CheckpointReader


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def _counting_reads(monkeypatch, store) -> tuple[Counter, Counter]:
    """Count the objects the store reads, by key (the real reads, passed through): manifest
    nodes (read whole) and tensor chunks (decoded into an output)."""
    nodes: Counter = Counter()
    chunks: Counter = Counter()
    real = store.objects.get

    def get(key, *args, **kwargs):
        (chunks if args or kwargs else nodes)[key] += 1
        return real(key, *args, **kwargs)

    monkeypatch.setattr(store.objects, "get", get)
    return nodes, chunks


def test_restore_reads_each_node_and_chunk_once(tmp_path, monkeypatch):
    model, opt = _trained()
    with cas.open(tmp_path / "s", chunk_size=64 << 10) as store:
        store.save({"model": model, "optimizer": opt, "step": 3}, step=3)
        fresh, fresh_opt = _trained(seed=1)
        slots = sum(len(t["chunks"]) for t in store.tensors(3))
        nodes, chunks = _counting_reads(monkeypatch, store)
        out = store.restore({"model": fresh, "optimizer": fresh_opt})
    assert out["step"] == 3
    assert nodes and max(nodes.values()) == 1, [k.hex()[:12] for k, n in nodes.items() if n > 1]
    assert sum(chunks.values()) == slots  # every chunk of every tensor decoded once
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


def test_reader_lists_entries_and_reads_one_tensor(tmp_path):
    model, opt = _trained()
    with cas.open(tmp_path / "s", chunk_size=64 << 10) as store:
        store.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 7}, step=1)
        reader = store.reader(1)
        assert isinstance(reader, CheckpointReader) and reader.step == 1
        assert reader.entries() == ["model", "optimizer", "epoch"]
        weight = reader.read_tensor("model.0.weight")
        assert torch.equal(weight, model.state_dict()["0.weight"])
        paths = [leaf.path for leaf in reader.leaves(["model"])]
        assert paths == [f"model.{k}" for k in model.state_dict()]
        assert [t["path"] for t in reader.tensors()][:4] == paths
        assert reader.materialize(["epoch"]) == {"epoch": 7}
        with pytest.raises(cas.CheckpointNotFoundError, match="no tensor 'model.9.weight'"):
            reader.read_tensor("model.9.weight")
        with pytest.raises(cas.CheckpointNotFoundError, match="no top-level entries"):
            reader.select("nope")


def test_read_tensor_of_a_wrong_type_is_a_type_error(tmp_path):
    with cas.open(tmp_path / "s") as store:
        store.save({"m": {"w": torch.ones(2)}, "epoch": 7}, step=1)
        reader = store.reader(1)
        epoch = next(leaf for leaf in reader.leaves() if leaf.path == "epoch")
        for wrong in (5, None, epoch):  # epoch: a Leaf, but of a plain value
            with pytest.raises(TypeError, match="read_tensor takes a tensor's path"):
                reader.read_tensor(wrong)
        assert torch.equal(reader.read_tensor(reader.tensor_leaves()["m.w"]), torch.ones(2))


def test_a_reader_keeps_reading_the_checkpoint_it_resolved(tmp_path):
    with cas.open(tmp_path / "s", chunk_size=64 << 10) as store:
        store.save({"w": torch.zeros(4)}, step=1)
        reader = store.reader()
        store.save({"w": torch.ones(4)}, step=2)
        store.delete(1)
        assert reader.step == 1 and torch.equal(reader.materialize()["w"], torch.zeros(4))
        assert store.reader().step == 2


@pytest.mark.parametrize("state, path", [
    (lambda t, u: {"a.b": t, "a": {"b": u}}, "a.b"),
    (lambda t, u: {1: t, "1": u}, "1"),
    (lambda t, u: {"a": t, "": {"a": u}}, "a"),
], ids=["dotted key", "int and str key", "empty key"])
def test_a_path_that_names_two_tensors_is_refused_and_diff_pairs_them_in_order(tmp_path, state, path):
    """Dotted paths of two tensors can coincide; read_tensor(path) returned the last of them,
    silently, whichever the caller meant, and diff compared only the last (audit of stop 38)."""
    with cas.open(tmp_path / "s") as store:
        store.save(state(torch.ones(2), torch.zeros(2)), step=1)
        store.save(state(torch.ones(2), torch.zeros(2) + 5), step=2)  # the second one changes
        reader = store.reader(1)
        with pytest.raises(cas.CasError, match=f"the path '{path}' names 2 tensors of checkpoint step 1"):
            reader.read_tensor(path)
        assert [reader.read_tensor(leaf).tolist() for leaf in reader.leaves()] == [[1.0, 1.0], [0.0, 0.0]]
        changes = [(c.path, c.status, c.max_abs_diff) for c in store.diff(1, 2).tensors]
        assert changes == [(path, "unchanged", None), (path, "changed", 5.0)]


def test_keys_may_be_one_int_and_a_state_that_is_no_dict_is_named_as_it_is(tmp_path):
    """load(step, keys=1) was "'int' object is not iterable" (top-level keys may be ints), and
    keys= on a state that is a bare tensor said it held a "Ref" (stop 38)."""
    with cas.open(tmp_path / "s") as store:
        store.save({1: torch.ones(1), "a": 2}, step=1)
        store.save(torch.ones(2), step=2)
        store.save([1, torch.ones(2)], step=3)
        assert list(store.load(1, keys=1)) == [1] and store.load(1, keys="a") == {"a": 2}
        for step, what in ((2, "tensor"), (3, "list")):
            with pytest.raises(cas.CasError, match=f"checkpoint step {step} holds a {what} at its top, not a dict"):
                store.load(step, keys=["a"])
