"""Decorators, injection checks and pipeline values (no processes here)."""

from __future__ import annotations

import inspect
import pickle
import re

import attrs
import cloudpickle
import pytest

import easycore
from easycore import Pipeline, Stage, WorkerError, compose, consumer, producer
from easycore import _options as easycore_options


@producer
def square(x):
    return x * x


@producer
def inc(x):
    return x + 1


@consumer(init=0)
def summer(total, x):
    return total + x


class TestDecorators:
    def test_bare_producer_stays_callable(self):
        """A decorated function is still an ordinary callable."""
        assert square(3) == 9
        assert isinstance(square, Stage)

    def test_consumer_stays_callable(self):
        """A consumer is callable as the fold function."""
        assert summer(1, 2) == 3

    def test_producer_with_options(self):
        """init/end are kept and their injected names recorded."""

        def load(device, cfg):
            return device

        @producer(init=load, end=lambda state: None)
        def f(x, *, state, device, cfg, worker):
            return x

        assert f.init is load
        assert f.init_names == ("device", "cfg")
        assert f.fn_names == ("state", "device", "cfg", "worker")
        assert f.end_names == ("state",)

    @pytest.mark.parametrize(
        ("make", "needle"),
        [
            (lambda: producer(lambda x, *, model: x), "'model'"),
            (lambda: producer(lambda x, *args: x), "*args"),
            (lambda: producer(lambda x, **kw: x), "**kw"),
            (lambda: producer(lambda: 1), "first positional"),
            (lambda: producer(lambda x, y: x), "'y'"),
            (lambda: producer(init=lambda state: 1)(lambda x: x), "'state'"),
            (lambda: producer(init=lambda gpu: 1)(lambda x: x), "'gpu'"),
            (lambda: producer(end=lambda foo: 1)(lambda x: x), "'foo'"),
            (lambda: consumer(lambda acc: acc), "first positional"),
            (lambda: consumer(lambda acc, x, *, device: acc), "'device'"),
            (lambda: consumer(init=lambda device: 0)(lambda a, x: a), "'device'"),
            (lambda: producer(init=3)(lambda x: x), "callable"),
        ],
    )
    def test_bad_signatures_fail_at_decoration(self, make, needle):
        """A parameter that cannot be injected is a TypeError naming it, at decoration time."""
        with pytest.raises(TypeError, match=needle.replace("*", r"\*")):
            make()

    def test_callables_without_signature_accepted(self):
        """`list` and C functions are fine as init/end."""
        import torch

        c = consumer(init=list, end=torch.cat)(lambda outs, y: outs.append(y))
        assert c.init is list
        assert c.end is torch.cat

    def test_defaults_with_injected_names(self):
        """Injected names may carry defaults (called standalone)."""

        @producer
        def f(x, device="cpu"):
            return (x, device)

        assert f(1) == (1, "cpu")
        assert f.fn_names == ("device",)

    def test_options_with_defaults_keep_their_defaults(self):
        """A parameter with a default that is not injectable is left alone: `sorted` as a
        consumer's end, a producer with an option of its own."""

        @consumer(init=list, end=sorted)
        def gather(outs, y):
            outs.append(y)

        @producer
        def scale(x, *, factor=3, device):
            return (x * factor, device)

        assert gather.end_names == ()
        assert scale.fn_names == ("device",)
        assert (scale >> gather).map([2, 1], devices="inline") == [(3, "cpu"), (6, "cpu")]
        assert scale(2, device="cpu", factor=5) == (10, "cpu")

    def test_double_decoration_refused(self):
        """Decorating a stage again is a mistake worth naming."""
        with pytest.raises(TypeError, match="already a stage"):
            producer(square)


class TestComposition:
    def test_rshift_builds_pipeline(self):
        """`a >> b` equals compose(a, b) and shows its stages."""
        p = square >> summer
        assert p == compose(square, summer)
        assert isinstance(p, Pipeline)
        assert repr(p) == "Pipeline(square >> summer)"
        assert p.producers == (square,)
        assert p.consumer is summer

    def test_associative(self):
        """(a >> b) >> c equals a >> (b >> c)."""
        assert (inc >> square) >> summer == inc >> (square >> summer)

    def test_operands_unchanged(self):
        """Every >> returns a new value; operands never change."""
        p = inc >> square
        q = p >> inc
        assert p.producers == (inc, square)
        assert q.producers == (inc, square, inc)
        assert p is not q

    def test_frozen(self):
        """A pipeline is an immutable attrs value."""
        p = inc >> square
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            p.consumer = summer  # type: ignore[misc]

    @pytest.mark.parametrize(
        ("build", "needle"),
        [
            (lambda: summer >> inc, "summer"),
            (lambda: (inc >> summer) >> inc, "summer"),
            (lambda: inc >> summer >> summer, "summer"),
            (lambda: inc >> 3, "3"),
            (lambda: 3 >> inc, "3"),
            (lambda: compose(inc, print), "print"),
            (lambda: inc >> (lambda x: x), "lambda"),
        ],
    )
    def test_bad_compositions(self, build, needle):
        """A wrong composition is a TypeError naming the offending operand."""
        with pytest.raises(TypeError, match=needle):
            build()

    def test_hashable_and_equal(self):
        """Pipelines compare by value and hash."""
        assert hash(inc >> square) == hash(inc >> square)
        assert {inc >> square, inc >> square} == {inc >> square}

    def test_pickle_by_reference(self):
        """Module-level stages travel by reference, pipelines by value around them."""
        p = inc >> square >> summer
        assert pickle.loads(pickle.dumps(p)) == p
        assert pickle.loads(pickle.dumps(square)) is square

    def test_cloudpickle_lambdas_and_closures(self):
        """Pipelines of closures survive cloudpickle and still compute."""
        k = 7
        add_k = producer(lambda x: x + k)
        p = add_k >> consumer(init=0)(lambda a, x: a + x)
        q = cloudpickle.loads(cloudpickle.dumps(p))
        assert repr(q) == repr(p)
        assert q.map([1, 2], devices="inline") == 17


class TestInlineRun:
    def test_map_inline(self):
        """devices='inline' runs everything here, same results."""
        assert (square >> summer).map(range(100), devices="inline") == 328350

    def test_bare_producer_and_pipeline_without_consumer(self):
        """Without a consumer, map returns a list."""
        assert square.map(range(4), devices="inline") == [0, 1, 4, 9]
        assert (inc >> square).map(range(3), devices="inline") == [1, 4, 9]

    def test_consumer_returning_none_keeps_accumulator(self):
        """Returning None from the fold keeps the accumulator (in-place updates)."""
        collect = consumer(init=list)(lambda outs, y: outs.append(y))
        assert (square >> collect).map(range(3), devices="inline") == [0, 1, 4]

    def test_value_init_is_fresh_per_run(self):
        """A mutable init value is copied, so runs do not share it."""
        collect = consumer(init=[])(lambda outs, y: outs.append(y))
        p = square >> collect
        assert p.map([1], devices="inline") == [1]
        assert p.map([2], devices="inline") == [4]

    def test_consumer_init_and_end_with_cfg(self):
        """Consumer init/end may take cfg."""
        c = consumer(init=lambda cfg: cfg.START, end=lambda acc, cfg: acc * cfg.K)(
            lambda a, x: a + x
        )
        assert (square >> c).map([1, 2], devices="inline", cfg={"START": 10, "K": 2}) == 30

    def test_imap_refuses_consumer(self):
        """imap is for pipelines without a consumer."""
        with pytest.raises(TypeError, match="imap"):
            (square >> summer).imap([1])
        with pytest.raises(TypeError, match="imap"):
            summer.imap([1])

    def test_a_stage_runs_like_a_one_stage_pipeline(self):
        """stage.map, imap and open take a pipeline's arguments, devices positional included."""
        for name in ("map", "imap", "open"):
            assert inspect.signature(getattr(square, name)) == inspect.signature(
                getattr(compose(square), name)
            )
        assert square.map([1, 2], "inline") == [1, 4]
        assert summer.map([1, 2], "inline", None, False) == 3
        assert list(square.imap([1, 2], "inline")) == [1, 4]
        with square.open("inline") as runner:
            assert runner.map([3]) == [9]


class TestBoolOptions:
    @pytest.mark.parametrize("option", ["ordered", "progress", "retry_failed"])
    @pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
    def test_anything_but_a_bool_is_refused_before_running(self, option, value):
        """ordered, progress and retry_failed take bools: else a TypeError naming both."""
        seen = []
        spy = producer(lambda x: seen.append(x) or x)
        kwargs = {option: value}
        match = rf"{option}.*{re.escape(repr(value))}"
        with pytest.raises(TypeError, match=match):
            spy.map([1], devices="inline", **kwargs)
        with pytest.raises(TypeError, match=match):
            (spy >> summer).map([1], devices="inline", **kwargs)
        with pytest.raises(TypeError, match=match):
            spy.imap([1], devices="inline", **kwargs)
        with spy.open(devices="inline") as runner:
            with pytest.raises(TypeError, match=match):
                runner.map([1], **kwargs)
            with pytest.raises(TypeError, match=match):
                runner.imap([1], **kwargs)
        assert seen == []


class TestRunOptionsSpelledOnce:
    """Every map/imap (Pipeline, Stage, Runner) takes the options of RunKwargs, checked alike."""

    def test_every_run_option_is_a_keyword_of_every_map(self):
        """RunKwargs names exactly the options a run has: none missing, none made up."""
        internal = {"numbering", "first", "passed"}  # set by the library, not the user
        fields = {f.name for f in attrs.fields(easycore_options.RunOptions)} - internal
        assert set(easycore.RunKwargs.__optional_keys__) == fields
        with square.open("inline") as runner:
            calls = [square.map, compose(square).map, runner.map, square.imap, runner.imap]
            for call in calls:
                assert list(call([1, 2], seed=1, retries=1, prefetch=3)) == [1, 4]

    @pytest.mark.parametrize("where", ["stage", "runner"])
    def test_a_misspelt_option_names_the_closest(self, where):
        """An unknown keyword is a TypeError that names the option meant, before any run."""
        with square.open("inline") as runner:
            call = square.map if where == "stage" else runner.map
            with pytest.raises(TypeError, match="'ordred'; did you mean 'ordered'"):
                call([1], ordred=False)

    def test_positional_options_follow_api_order(self):
        """ordered, batch_size, progress, seed, timeout, retries by position; no more, no twice."""
        batches = producer(lambda xs: list(xs))
        assert batches.map([1, 2, 3], "inline", None, True, 2) == [[1, 2], [3]]
        with pytest.raises(TypeError, match="multiple values for argument 'ordered'"):
            square.map([1], "inline", None, True, ordered=True)
        with pytest.raises(TypeError, match="at most 6 options by position"):
            square.map([1], "inline", None, True, None, False, None, None, 0, 2)


class TestOn:
    def test_on_makes_a_pool(self):
        p = square.on(4)
        assert isinstance(p, Pipeline)
        assert len(p.pools) == 1
        stages, binding = p.pools[0]
        assert stages == (square,)
        assert binding.devices == 4 and binding.batch_size is None

    def test_pools_cut_at_each_on_and_unbound_runs_fuse(self):
        p = square.on(2) >> inc >> inc >> square.on(["cpu"], batch_size=3) >> summer
        assert [tuple(s.name for s in stages) for stages, _ in p.pools] == [
            ("square",),
            ("inc", "inc"),
            ("square",),
        ]
        assert [b if b is None else (b.devices, b.batch_size) for _, b in p.pools] == [
            (2, None),
            None,
            (("cpu",), 3),
        ]
        assert p.consumer is summer

    def test_a_fused_run_binds_as_one_pool(self):
        p = (square >> inc).on(2) >> inc.on(1)
        assert [len(stages) for stages, _ in p.pools] == [2, 1]
        assert repr(p) == "Pipeline((square >> inc).on(2) >> inc.on(1))"

    def test_two_equal_on_calls_are_two_pools(self):
        assert len((square.on(2) >> inc.on(2)).pools) == 2

    def test_on_leaves_operands_unchanged(self):
        base = square >> inc
        bound = base.on(3)
        assert base.placement == (None, None)
        assert bound is not base and bound.producers == base.producers

    def test_refusals(self):
        with pytest.raises(TypeError, match="consumer"):
            summer.on(2)
        with pytest.raises(TypeError, match="consumer"):
            (square >> summer).on(2)
        with pytest.raises(TypeError, match="already bound"):
            square.on(2).on(3)
        with pytest.raises(ValueError, match="inline"):
            square.on("inline")
        with pytest.raises(ValueError, match="batch_size"):
            square.on(2, batch_size=0)

    def test_bad_devices_fail_before_any_process(self):
        with pytest.raises(ValueError, match="tpu"):
            (square.on("tpu") >> inc.on(1)).map([1])

    def test_bound_pipeline_pickles(self):
        p = square.on(2, batch_size=4) >> inc.on(1) >> summer
        q = cloudpickle.loads(cloudpickle.dumps(p))
        assert [(b.devices, b.batch_size) for _, b in q.pools] == [(2, 4), (1, None)]

    def test_inline_run_of_pools(self):
        p = inc.on(2) >> square.on(1, batch_size=2)
        with pytest.raises(WorkerError, match="list"):
            p.map([1, 2, 3], devices="inline")  # square gets lists: list * list fails
        out = (inc.on(2) >> inc.on(1)).map([1, 2, 3], devices="inline")
        assert out == [3, 4, 5]

    def test_distributed_with_pools_is_refused(self):
        with pytest.raises(ValueError, match="distributed"):
            (inc.on(1) >> inc.on(1)).map([1], distributed=True)


class TestSeedingHelpers:
    def test_a_loop_of_ones_own_agrees_with_the_workers(self):
        """seed_everything(derive_seed(seed, i)) gives item i the random state a seeded map
        gives it."""
        import random

        import torch

        from easycore import derive_seed, seed_everything

        @producer
        def draw(x):
            return (x, random.random(), float(torch.rand(1)))

        mapped = draw.map(range(6), devices=2, seed=11)
        mine = []
        for i in range(6):
            seed_everything(derive_seed(11, i))
            mine.append((i, random.random(), float(torch.rand(1))))
        assert mapped == mine
        assert derive_seed(11, 1) != derive_seed(11, 2) != derive_seed(12, 2)
