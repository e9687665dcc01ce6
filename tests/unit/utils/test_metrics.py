"""Each step appears once in a metrics file, also after a resume that redoes steps."""

from prime_rl.protocol import metrics_file
from prime_rl.utils.metrics import MetricsWriter, read_metrics


def test_a_resumed_writer_drops_the_steps_it_redoes(tmp_path):
    writer = MetricsWriter(tmp_path, "trainer")
    for step in range(6):
        writer.log(step, {"loss": float(step)})
    writer.close()
    with open(metrics_file(tmp_path, "trainer"), "a") as f:
        f.write('{"step": 6, "lo')  # a line cut short by a crash
    resumed = MetricsWriter(tmp_path, "trainer", first_step=3)  # resumed from checkpoints/step_3
    for step in range(3, 5):
        resumed.log(step, {"loss": 10.0 + step})
    resumed.close()
    assert [(m["step"], m["loss"]) for m in read_metrics(tmp_path, "trainer")] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0),
    ]  # fmt: skip
    MetricsWriter(tmp_path, "trainer").close()  # a fresh run starts a fresh file
    assert read_metrics(tmp_path, "trainer") == []
