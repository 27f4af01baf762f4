"""torch's profiler sees plain code's calls: one ``{backend}:{call}`` event each, with its inputs.

torch.distributed's backends record each collective on the thread that calls
it (``gloo:all_reduce``, with the input tensors' shapes), ended when the
operation ends: the event is asynchronous, and a trace of a training step
shows where communication ran. ``aiodist.sync`` starts its operations on the
loop thread, which a profiler started on the caller's thread does not see, so
the doors of ``portal`` start the event here, on the caller's thread, and end
it when the operation ends, on the loop thread, as torch's rpc does: through a
``torch.futures.Future`` that carries the caller's profiler state to the end.

Nothing is recorded unless this thread is being profiled (``torch.profiler``
or ``torch.autograd.profiler.profile``): then a call costs one attribute read.
The inputs are read from the call's own arguments, by name: the first of
``INPUT_NAMES`` that the function has (torch's own names), its tensors in
order; complex tensors as their real view, as torch records them. Events are
named as gloo names them (``TORCH_NAMES``: ``isend`` records ``gloo:send``).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import TYPE_CHECKING, Any, Final

from aiodist._group.world import get_backend

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    import torch

#: The parameters that hold a call's inputs, in the order looked for (torch's names).
INPUT_NAMES: Final = (
    "input",
    "input_tensor",
    "input_list",
    "input_tensor_list",
    "scatter_list",
    "tensors",
    "tensor",
)

#: The calls whose event torch names otherwise (gloo's names: a trace reads the same).
TORCH_NAMES: Final = {
    "all_gather_into_tensor": "all_gather",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}


def begin(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    tensors_only: bool = False,
) -> Callable[[], None] | None:
    """Start ``fn(*args, **kwargs)``'s event if this thread is profiled; return what ends it.

    None when this thread is not profiled. The returned function may be called
    from any thread, once. ``tensors_only``: only if ``fn`` takes tensors
    (``send``, not ``new_group``).
    """
    profiler = sys.modules.get("torch.autograd.profiler")
    if profiler is None or not profiler._is_profiler_enabled:  # any thread's profiler on
        return None
    import torch

    if not torch._C._autograd._profiler_enabled():  # this thread's
        return None
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None  # the call itself raises the error
    inputs = next((n for n in INPUT_NAMES if n in bound.signature.parameters), None)
    if tensors_only and inputs is None:
        return None
    try:
        backend = get_backend(bound.arguments.get("group"))
    except Exception:  # the call itself says what is wrong with its group
        return None
    if backend is None:
        return None  # not initialised: nothing is sent
    name = TORCH_NAMES.get(fn.__name__, fn.__name__)
    source = bound.arguments.get("src", 0)
    if name == "recv" and source is None and bound.arguments.get("group_src") is None:
        name = "recvAnySource"  # torch's name for a receive from any rank
    handle = torch._C._autograd._record_function_with_args_enter(
        f"{backend}:{name}", *tensors_of(bound.arguments.get(inputs or ""))
    )
    ended: torch.futures.Future[None] = torch.futures.Future()
    torch.ops.profiler._call_end_callbacks_on_jit_fut(handle, ended)
    return functools.partial(ended.set_result, None)


def tensors_of(value: object) -> list[torch.Tensor]:
    """The tensors of an argument (a tensor, or lists of them) in order, complex ones as real."""
    import torch

    found: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(torch.view_as_real(item) if item.is_complex() else item)
        elif isinstance(item, list | tuple):
            stack.extend(reversed(item))
    return found
