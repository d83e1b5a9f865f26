"""Metric names, writers (jsonl, TensorBoard), and a terminal progress display.

Plain Python (numpy/jax values are unwrapped by duck typing); imports nothing jax-heavy.
Charts: `python -m jrl.cli.plot RUN_DIR` reads the metrics.jsonl written here.
"""

from jrl.metrics import names
from jrl.metrics.names import ALL_METRIC_NAMES
from jrl.metrics.progress import ProgressBar, format_duration
from jrl.metrics.writers import (
    METRICS_FILENAME,
    NONFINITE_KEY,
    TENSORBOARD_DIRNAME,
    JsonlWriter,
    MetricWriter,
    MultiWriter,
    NullWriter,
    TensorBoardWriter,
    decode_record,
    encode_record,
    make_writers,
    read_metrics,
    tensorboard_available,
    to_python_scalar,
)

__all__ = [
    "ALL_METRIC_NAMES",
    "JsonlWriter",
    "METRICS_FILENAME",
    "MetricWriter",
    "MultiWriter",
    "NONFINITE_KEY",
    "NullWriter",
    "ProgressBar",
    "TENSORBOARD_DIRNAME",
    "TensorBoardWriter",
    "decode_record",
    "encode_record",
    "format_duration",
    "make_writers",
    "names",
    "read_metrics",
    "tensorboard_available",
    "to_python_scalar",
]
