"""A step's cache written in place, where its library copies it.

keras-hub's ``call_with_cache`` takes the cache as one array ``[batch, layers, 2, length,
heads, head_dim]`` and, per layer, slices out the layer's keys and values, writes the new
position into each (``slice_update``) and stacks them back together, then stacks the
layers: the result is the input with a few positions changed, but XLA sees a
``concatenate`` of updated slices and writes the whole cache anew each step, after two
more copies of each slice (keras-llama at 8 slots and 512 positions: 16 MB moved per
step for 16 KB of new keys and values).

``in_place(step, argnum)`` runs ``step`` as the same computation with the cache's
updates made on the argument itself: it traces ``step`` to a jaxpr and evaluates it
again, keeping the values that are pieces of the argument as *views* (a region of the
argument, some of its axes dropped) rather than arrays. A ``slice`` or ``squeeze`` of a
view is a view; a ``dynamic_update_slice`` into a view is a ``dynamic_update_slice``
of the whole argument (in place once XLA has the argument donated); a ``stack`` or
``concatenate`` of views that are neighbouring parts of the argument is the view of
their union, so the returned cache is the updated argument itself. Any other use of a
view reads it from the argument as it is then; a view whose region a later write
overwrites keeps its old value, read before that write.

The same evaluation reads grouped-query attention without its repeat: keras-hub gives
each query head its key and value head with ``ops.repeat`` (a broadcast that adds an
axis, a reshape that merges it), and XLA:CPU writes the repeated keys and values out
before each dot (twice the cache's bytes, per layer, each step). A repeat that feeds a
``dot_general`` as a batch dimension is kept unmade (``_Repeat``) and the dot runs on
the unrepeated operand, the other operand's heads split into (key heads, group):
the same sums, in a grouped order. Used any other way, the repeat is made.

The result is the same computation; only the copies go. keras-hub's Llama at 8 slots
(``benchmarks/cache_in_place.py``): the decode program in 0.82x / 0.66x / 0.54x the
time at 128 / 256 / 512 positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass
class _View:
    """A region of argument leaf ``root`` (``start`` and ``size`` per axis of the
    leaf) with only the leaf's axes in ``axes`` kept, as it was after the leaf's first
    ``version`` writes. ``old`` is its value from before a later write overlapped it."""

    root: int
    start: tuple[int, ...]
    size: tuple[int, ...]
    axes: tuple[int, ...]
    version: int
    old: Any = None

    def overlaps(self, start: Sequence[int], size: Sequence[int]) -> bool:
        return all(
            a < b + m and b < a + n for a, n, b, m in zip(self.start, self.size, start, size)
        )

    def whole(self, shape: tuple[int, ...]) -> bool:
        return (
            self.axes == tuple(range(len(shape)))
            and self.start == (0,) * len(shape)
            and self.size == shape
        )


class _Leaves:
    """The argument's leaves as they are written, and every view taken of them."""

    def __init__(self, arrays: list[Any]) -> None:
        self.arrays = arrays
        self.views: list[list[_View]] = [[] for _ in arrays]
        self.writes: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = [[] for _ in arrays]

    def view(self, root: int, start: Any, size: Any, axes: Any, version: int | None = None) -> Any:
        """The view (None if a write since ``version`` overlaps it: the caller then
        uses the value)."""
        if version is None:
            version = len(self.writes[root])
        v = _View(root, tuple(start), tuple(size), tuple(axes), version)
        if not self.current(v):
            return None
        self.views[root].append(v)
        return v

    def current(self, v: _View) -> bool:
        return not any(v.overlaps(s, n) for s, n in self.writes[v.root][v.version :])

    def read(self, v: _View) -> Any:
        from jax import lax

        if not self.current(v):
            return v.old
        x = self.arrays[v.root]
        x = lax.slice(x, v.start, tuple(s + n for s, n in zip(v.start, v.size)))
        dropped = tuple(a for a in range(x.ndim) if a not in v.axes)
        return lax.squeeze(x, dropped) if dropped else x

    def write(self, v: _View, update: Any, index: Sequence[Any]) -> _View:
        """``dynamic_update_slice(v, update, *index)`` made on the leaf."""
        from jax import lax

        for w in self.views[v.root]:  # what is overwritten keeps its value
            if w.old is None and w.overlaps(v.start, v.size) and self.current(w):
                w.old = self.read(w)
        shape = tuple(v.size[a] for a in v.axes)
        starts: list[Any] = list(v.start)
        for k, a in enumerate(v.axes):  # (clamped as the view's own update would be)
            i = lax.convert_element_type(index[k], "int32")
            starts[a] = v.start[a] + lax.clamp(0, i, shape[k] - update.shape[k])
        leaf = self.arrays[v.root]
        dropped = tuple(a for a in range(leaf.ndim) if a not in v.axes)
        update = lax.expand_dims(update, dropped).astype(leaf.dtype)
        self.arrays[v.root] = lax.dynamic_update_slice(leaf, update, starts)
        self.writes[v.root].append((v.start, v.size))
        return self.view(v.root, v.start, v.size, v.axes)

    def joined(self, views: Sequence[Any], axis: int, new_axis: bool) -> Any:
        """The view of ``views`` side by side along ``axis`` (a new one for ``stack``),
        if they are neighbouring parts of one leaf; else None."""
        if not views or not all(isinstance(v, _View) and self.current(v) for v in views):
            return None
        first = views[0]
        if any(v.root != first.root or v.axes != first.axes for v in views):
            return None
        if new_axis:  # the leaf's axis that the parts step along, dropped in each
            free = [a for a in range(len(first.start)) if a not in first.axes]
            free = [a for a in free if all(v.size[a] == 1 for v in views)]
            if len(views) > 1:
                free = [a for a in free if views[1].start[a] == first.start[a] + 1]
            free = [a for a in free if sorted((*first.axes, a)).index(a) == axis]
            if not free:
                return None
            along, axes = free[-1], tuple(sorted((*first.axes, free[-1])))
        else:
            along, axes = first.axes[axis], first.axes
        end = first.start[along]
        for v in views:
            if v.start[along] != end or any(
                (v.start[a], v.size[a]) != (first.start[a], first.size[a])
                for a in range(len(v.start))
                if a != along
            ):
                return None
            end += v.size[along]
        size = list(first.size)
        size[along] = end - first.start[along]
        return self.view(first.root, first.start, size, axes)


def _fixed_index(params: dict, indices: Any, v: _View) -> dict[int, int] | None:
    """A gather that is a static index (``x[:, i]``: one known index vector, every
    indexed axis dropped, whole slices of the others) as {leaf axis: index}; else None."""
    import jax
    import numpy as np

    dims = params["dimension_numbers"]
    if isinstance(indices, (_View, jax.core.Tracer)) or dims.operand_batching_dims:
        return None
    indices = np.asarray(indices)
    shape = tuple(v.size[a] for a in v.axes)
    indexed = tuple(dims.start_index_map)
    if (
        indices.shape != (len(indexed),)
        or tuple(dims.collapsed_slice_dims) != tuple(sorted(indexed))
        or tuple(dims.offset_dims) != tuple(range(len(shape) - len(indexed)))
    ):
        return None
    if any(params["slice_sizes"][k] != (1 if k in indexed else n) for k, n in enumerate(shape)):
        return None
    at = {}
    for k, i in zip(indexed, indices.tolist()):
        if not isinstance(shape[k], int) or not 0 <= i < shape[k]:
            return None
        at[v.axes[k]] = int(i)
    return at


def _as_view(leaves: _Leaves, name: str, params: dict, ins: list[Any]) -> Any:
    """What the equation makes of a view as its first operand, as a view; None where
    it is not one (the equation then runs on values)."""
    v = ins[0]
    if name == "slice" and set(params["strides"] or (1,)) == {1}:
        start, size = list(v.start), list(v.size)
        for k, a in enumerate(v.axes):
            start[a] += params["start_indices"][k]
            size[a] = params["limit_indices"][k] - params["start_indices"][k]
        return leaves.view(v.root, start, size, v.axes, v.version)
    if name == "gather":  # (``x[:, i]`` where x has a symbolic dimension)
        at = _fixed_index(params, ins[1], v)
        if at is None:
            return None
        start, size = list(v.start), list(v.size)
        for a, i in at.items():
            start[a], size[a] = start[a] + i, 1
        dropped = params["dimension_numbers"].collapsed_slice_dims
        kept = [a for k, a in enumerate(v.axes) if k not in dropped]
        return leaves.view(v.root, start, size, kept, v.version)
    if name == "squeeze":
        dropped = {v.axes[k] for k in params["dimensions"]}
        kept = [a for a in v.axes if a not in dropped]
        return leaves.view(v.root, v.start, v.size, kept, v.version)
    if name == "dynamic_update_slice" and leaves.current(v):
        value = [leaves.read(x) if isinstance(x, _View) else x for x in ins[1:]]
        return leaves.write(v, value[0], value[1:])
    return None


@dataclasses.dataclass
class _Repeat:
    """``jnp.repeat(x, times, axis)`` not yet made (a broadcast that adds an axis of
    ``times`` after ``axis``, then a reshape that merges the two: how keras-hub gives
    each query head of a group its key and value head). ``made`` makes it."""

    x: Any
    axis: int
    times: int
    made: Callable[[], Any]
    merged: bool = False  # (False: the broadcast only, before the reshape)


def _once(make: Callable[[], Any]) -> Callable[[], Any]:
    """``make``, called once however often it is asked for."""
    made: list[Any] = []

    def get() -> Any:
        if not made:
            made.append(make())
        return made[0]

    return get


def _as_repeat(eqn: Any, ins: list[Any]) -> Any:
    """The broadcast (of a value) or reshape (of a ``_Repeat``) that begins or ends a
    repeat, as a ``_Repeat``; else None."""
    params = eqn.params
    x = ins[0]
    if eqn.primitive.name == "broadcast_in_dim":
        shape, dims = tuple(params["shape"]), tuple(params["broadcast_dimensions"])
        new = [a for a in range(len(shape)) if a not in dims]
        if (
            len(ins) == 1
            and len(new) == 1
            and new[0] > 0
            and dims == tuple(a for a in range(len(shape)) if a != new[0])
            and tuple(x.shape) == tuple(shape[a] for a in dims)
        ):
            return _Repeat(x, new[0] - 1, shape[new[0]], _once(lambda: _bind(eqn, ins, False)))
    if eqn.primitive.name == "reshape" and isinstance(x, _Repeat) and not x.merged:
        shape, a = tuple(x.x.shape), x.axis
        merged = (*shape[:a], shape[a] * x.times, *shape[a + 1 :])
        if params["dimensions"] is None and tuple(params["new_sizes"]) == merged:
            made = _once(lambda: _bind(eqn, [x.made()], False))
            return dataclasses.replace(x, merged=True, made=made)
    return None


def _grouped_dot(eqn: Any, ins: list[Any]) -> Any:
    """A ``dot_general`` with a repeat as an operand whose repeated axis is a batch
    dimension, as the dot over the unrepeated operand, the other's paired axis split
    into (heads, times): the same values, without the repeat's copy. Else None. (Views
    come read: ``ins`` are values or repeats.)"""
    from jax import lax

    lhs, rhs = ins
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if isinstance(rhs, _Repeat) and rhs.merged and not isinstance(lhs, _Repeat):
        rep, other, rep_b, oth_b, rep_c, oth_c = rhs, lhs, rb, lb, rc, lc
    elif isinstance(lhs, _Repeat) and lhs.merged and not isinstance(rhs, _Repeat):
        rep, other, rep_b, oth_b, rep_c, oth_c = lhs, rhs, lb, rb, lc, rc
    else:
        return None
    if rep.axis not in rep_b:
        return None
    pair = list(rep_b).index(rep.axis)
    at = oth_b[pair]  # the other's axis of the repeated heads: split it
    heads = rep.x.shape[rep.axis]
    split = lax.reshape(other, (*other.shape[:at], heads, rep.times, *other.shape[at + 1 :]))
    moved = (
        tuple(a + 1 if a > at else a for a in oth_b),
        tuple(a + 1 if a > at else a for a in oth_c),
    )
    params = dict(eqn.primitive.get_bind_params(eqn.params))  # (a copy: the jaxpr's own)
    # Where the group axis lands in the dot's output: after the batch axes and the
    # free axes of the lhs before it.
    free = [a for a in range(split.ndim) if a not in moved[0] + moved[1]]
    times_at = len(rep_b) + free.index(at + 1)
    if rep is rhs:
        params["dimension_numbers"] = ((moved[1], rep_c), (moved[0], rep_b))
        out = eqn.primitive.bind(split, rep.x, **params)
    else:
        params["dimension_numbers"] = ((rep_c, moved[1]), (rep_b, moved[0]))
        out = eqn.primitive.bind(rep.x, split, **params)
        times_at += rep.x.ndim - len(rep_b) - len(rep_c)
    order = [a for a in range(out.ndim) if a != times_at]
    order.insert(pair + 1, times_at)
    out = lax.transpose(out, order) if order != sorted(order) else out
    shape = out.shape
    out = lax.reshape(out, (*shape[:pair], shape[pair] * shape[pair + 1], *shape[pair + 2 :]))
    # (a layout this does not foresee: the dot as it is, on the repeat made)
    return out if tuple(out.shape) == tuple(eqn.outvars[0].aval.shape) else None


def _bind(eqn: Any, ins: list[Any], known: bool) -> Any:
    """The equation on values (at trace time where ``known`` and it can be: a
    symbolic dimension's value cannot)."""
    import jax

    params = eqn.primitive.get_bind_params(eqn.params)
    if known:
        try:
            with eqn.ctx.manager, jax.ensure_compile_time_eval():
                return eqn.primitive.bind(*ins, **params)
        except NotImplementedError:
            pass
    with eqn.ctx.manager:
        return eqn.primitive.bind(*ins, **params)


def _small(outvars: Sequence[Any]) -> bool:
    """Whether every output is an integer array of a few elements, its shape known."""
    import numpy as np

    for v in outvars:
        shape = getattr(v.aval, "shape", None)
        dtype = getattr(v.aval, "dtype", None)
        if shape is None or dtype is None or not np.issubdtype(dtype, np.integer):
            return False
        if not all(isinstance(n, int) for n in shape) or int(np.prod(shape)) > 8:
            return False
    return True


def in_place(step: Callable[..., Any], argnum: int) -> Callable[..., Any]:
    """``step`` with its argument ``argnum``'s leaves updated in place where it writes
    into slices of them and returns them whole, and its repeats that feed a dot read
    grouped (the module docstring)."""

    def run(*args: Any) -> Any:
        import jax
        import jax.extend.core as jcore

        closed, out_shape = jax.make_jaxpr(step, return_shape=True)(*args)
        values = jax.tree.leaves(args)
        counts = [len(jax.tree.leaves(a)) for a in args]
        marked = [i == argnum for i, n in enumerate(counts) for _ in range(n)]
        leaves = _Leaves([x for x, m in zip(values, marked) if m])
        env: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts))
        roots = iter(range(len(leaves.arrays)))
        for var, x, m in zip(closed.jaxpr.invars, values, marked):
            env[var] = leaves.view(next(roots), (0,) * x.ndim, x.shape, range(x.ndim)) if m else x

        def get(a: Any) -> Any:
            return a.val if isinstance(a, jcore.Literal) else env[a]

        def value(x: Any) -> Any:
            if isinstance(x, _Repeat):
                return x.made()
            return leaves.read(x) if isinstance(x, _View) else x

        for eqn in closed.jaxpr.eqns:
            ins = [get(a) for a in eqn.invars]
            name = eqn.primitive.name
            out = None
            if ins and isinstance(ins[0], _View):
                out = _as_view(leaves, name, eqn.params, ins)
            if out is None and name in ("stack", "concatenate"):
                axis = eqn.params["axis" if name == "stack" else "dimension"]
                out = leaves.joined(ins, axis, name == "stack")
            if out is None and name == "broadcast_in_dim":
                out = _as_repeat(eqn, [value(x) for x in ins])
            if out is None and name == "reshape":
                out = _as_repeat(eqn, ins)
            if out is None and name == "dot_general":
                out = _grouped_dot(eqn, [value(x) if isinstance(x, _View) else x for x in ins])
            if out is None:
                # Small values computed from constants only (an index) stay known:
                # under an outer trace they would be traced, and ``x[:, i]`` (a gather
                # where a dimension is symbolic) needs its ``i``.
                known = _small(eqn.outvars) and not any(
                    isinstance(x, (_View, jax.core.Tracer)) for x in ins
                )
                out = _bind(eqn, [value(x) for x in ins], known)
            if eqn.primitive.multiple_results:
                env.update(zip(eqn.outvars, out))
            else:
                env[eqn.outvars[0]] = out
        outs = []
        for a in closed.jaxpr.outvars:
            x = get(a)
            if isinstance(x, _View) and leaves.current(x):
                leaf = leaves.arrays[x.root]
                outs.append(leaf if x.whole(tuple(leaf.shape)) else leaves.read(x))
            else:
                outs.append(value(x))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run
