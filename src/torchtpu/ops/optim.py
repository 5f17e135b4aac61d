"""Fused optimizer steps (``torch.optim.Adam/AdamW/SGD(fused=True)``), as PyTorch's fused kernels.

``_fused_adamw_`` updates every parameter, gradient and state tensor of a parameter group in one
call; here that call is one program on the device. The update follows CUDA's fused kernels
(``aten/src/ATen/native/cuda/fused_adam_utils.cuh``, ``FusedSgdKernel.cu``) element for element:
the gradient is divided by ``grad_scale`` and written back, a set ``found_inf`` leaves everything
untouched, and low-precision tensors compute in fp32. Without these lowerings the step ran through
the CPU fallback every step, which Hugging Face's ``Trainer`` (fused AdamW by default) hit.

Eager runs the in-place overloads (``mutates=``: the written lists' new values come back flat,
in argument order); compiled graphs get the functional overloads from functionalisation.
"""

from __future__ import annotations

import jax.numpy as jnp

from torchtpu.ops.dtypes import to_opmath as _up
from torchtpu.ops.registry import aten, lowering

_ADAM_STATE = ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")
_SGD_STATE = ("self", "grads", "momentum_buffer_list")


def _scalar(x):
    """A 1-element tensor argument (lr, grad_scale, found_inf) as a 0-d value."""
    return x.reshape(()) if hasattr(x, "reshape") else x


def _skip(found_inf):
    return None if found_inf is None else _scalar(found_inf) != 0


def _keep(skip, new, old):
    """``new`` cast to ``old``'s dtype, or ``old`` where the step is skipped (an inf was found)."""
    new = new.astype(old.dtype)
    return new if skip is None else jnp.where(skip, old, new)


def _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
          weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled):
    """The five updated lists of Adam (``decoupled=False``) or AdamW (``decoupled=True``)."""
    skip, lr = _skip(found_inf), _scalar(lr)
    out = ([], [], [], [], [])
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
        pf, gf, mf, vf = _up(p), _up(g), _up(m), _up(v)
        if grad_scale is not None:
            gf = gf / _scalar(grad_scale)
        stored_grad = gf
        if maximize:
            gf = -gf
        if decoupled:
            pf = pf - lr * weight_decay * pf
        elif weight_decay != 0:
            gf = gf + pf * weight_decay
        mf = beta1 * mf + (1 - beta1) * gf
        vf = beta2 * vf + (1 - beta2) * gf * gf
        step = _up(_scalar(step)).astype(jnp.float32)
        bias1 = 1 - jnp.power(jnp.float32(beta1), step)
        bias2_sqrt = jnp.sqrt(1 - jnp.power(jnp.float32(beta2), step))
        if amsgrad:
            old_max = max_exp_avg_sqs[i]
            top = jnp.maximum(_up(old_max), vf)
            out[4].append(_keep(skip, top, old_max))
            denom = jnp.sqrt(top) / bias2_sqrt + eps
        else:
            denom = jnp.sqrt(vf) / bias2_sqrt + eps
        pf = pf - (lr / bias1) * mf / denom
        for target, new, old in zip(out, (pf, stored_grad, mf, vf), (p, g, m, v)):
            target.append(_keep(skip, new, old))
    return out


def _sgd(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov, maximize,
         is_first_step, grad_scale, found_inf):
    """The three updated lists of SGD (with momentum when ``momentum`` != 0)."""
    skip, lr = _skip(found_inf), _scalar(lr)
    out = ([], [], [])
    for i, (p, g) in enumerate(zip(params, grads)):
        pf, gf = _up(p), _up(g)
        if grad_scale is not None:
            gf = gf / _scalar(grad_scale)
        out[1].append(_keep(skip, gf, g))
        if maximize:
            gf = -gf
        if weight_decay != 0:
            gf = gf + weight_decay * pf
        if momentum != 0:
            old = momentum_buffer_list[i]
            buf = gf if is_first_step else momentum * _up(old) + (1 - dampening) * gf
            out[2].append(_keep(skip, buf, old))
            gf = gf + momentum * buf if nesterov else buf
        out[0].append(_keep(skip, pf - lr * gf, p))
    return out


def _register(name: str, fn, state: tuple[str, ...], **fixed) -> None:
    """The functional, in-place and ``out=`` overloads (float and tensor lr) of one fused step."""
    functional, inplace = getattr(aten, name), getattr(aten, name + "_")

    def step(*lists, grad_scale=None, found_inf=None, **hyper):
        return fn(*lists, grad_scale=grad_scale, found_inf=found_inf, **hyper, **fixed)

    def step_(*lists, **kwargs):  # written lists' new values come flat, one per element
        return tuple(x for new in step(*lists, **kwargs) for x in new)

    def step_out(*lists, out, **kwargs):  # self's new values go to out; the other lists are written
        new = step(*lists, **kwargs)
        return tuple(x for written in (*new[1:], new[0]) for x in written)

    step.__name__, step_.__name__, step_out.__name__ = name, name + "_", name + "_out"
    lowering(functional.default, functional.tensor_lr)(step)
    # lr is a value, not a constant: a scheduler changes it every step (one program, not one per lr)
    lowering(inplace.default, inplace.tensor_lr, mutates=state, dynamic=("lr",))(step_)
    lowering(functional.out, functional.tensor_lr_out, mutates=(*state[1:], "out"), dynamic=("lr",))(step_out)


_register("_fused_adam", _adam, _ADAM_STATE, decoupled=False)
_register("_fused_adamw", _adam, _ADAM_STATE, decoupled=True)
_register("_fused_sgd", _sgd, _SGD_STATE)
