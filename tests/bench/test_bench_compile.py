"""bench compile: the four variants run, agree on the first loss, count 0 graph breaks, and write md/json."""

from keyfold.bench import compile as bc


def test_bench_compile_smoke(tmp_path):
    c = bc.Config(vocab=32, d_model=16, n_heads=2, n_kv_heads=1, n_layers=1, seq=8, batch=1)
    res = bc.run(c, "eager", repeats=1)
    assert set(res) == {"keyfold", "sdpa"}
    for r in res.values():
        assert r["graph_breaks"] == 0
        assert abs(r["first_loss_eager"] - r["first_loss_compiled"]) < 1e-5
    assert abs(res["keyfold"]["first_loss_eager"] - res["sdpa"]["first_loss_eager"]) < 1e-4
    md = bc.write(res, dict(machine="test", backend="eager", model=str(c)), tmp_path, "compile.test", "cmd")
    assert "| keyfold | 0 |" in md.read_text() and (tmp_path / "compile.test.json").exists()
