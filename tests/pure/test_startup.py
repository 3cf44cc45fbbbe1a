"""compat.startup: Megatron-core's `torch.compile` decorations compile on the first call, with the
decorator's own options, once; the decorated function's identity (name, docstring) is kept."""

from __future__ import annotations

from megatron_hetero.compat.startup import deferred_compile


def _recording_compile():
    calls: list[tuple[object, dict]] = []

    def compile_fn(fn, **options):
        calls.append((fn, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    return calls, compile_fn


def test_compiles_on_first_call_only_with_the_same_options():
    calls, compile_fn = _recording_compile()
    deferred = deferred_compile(compile_fn)

    def fused(x, y=1):
        """doc"""
        return x + y

    wrapped = deferred(fused, dynamic=False)
    assert calls == [] and wrapped.__name__ == "fused" and wrapped.__doc__ == "doc"
    assert wrapped(2, y=3) == ("compiled", 5)
    assert wrapped(1) == ("compiled", 2)
    assert calls == [(fused, {"dynamic": False})]


def test_decorator_with_options_form():
    calls, compile_fn = _recording_compile()
    deferred = deferred_compile(compile_fn)

    @deferred(mode="max-autotune")
    def fused(x):
        return 2 * x

    assert calls == []
    assert fused(4) == ("compiled", 8)
    assert calls == [(fused.__wrapped__, {"mode": "max-autotune"})]
