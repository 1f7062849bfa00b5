"""compose: a sink given inside a pipeline is checked as a bare sink is."""

import pytest

from easycore import compose, consumer, write


def test_a_pipeline_of_a_sink_cannot_follow_a_consumer(tmp_path):
    """A consumer then compose(sink) is the error a consumer then the sink itself is."""
    summer = consumer(init=0)(lambda total, x: total + x)
    sink = write.parquet(str(tmp_path / "out"))
    for last in (sink, compose(sink)):
        with pytest.raises(TypeError, match="cannot follow the consumer"):
            compose(summer, last)
