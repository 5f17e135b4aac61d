"""Fused RNN cells: the per-step ops PyTorch's LSTM/GRU (and their cells) call on a non-CPU device.

``lstm``/``gru`` on ``tpu`` run PyTorch's generic RNN loop, which does the two gate matmuls itself
and calls ``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell`` for the pointwise rest. The
workspace the forward returns is ours to define (the CPU has no kernel for these ops): like
PyTorch's CUDA kernels we save the activated gates, and the backward ops derive every gradient
from them with the closed-form derivatives of sigmoid and tanh (the pre-activations are not saved,
so there is no forward to ``jax.vjp``). Low-precision inputs compute in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchtpu.ops.dtypes import opmath
from torchtpu.ops.registry import aten, lowering


def _up(x):
    return None if x is None else x.astype(opmath(x.dtype))


def _gates(input_gates, hidden_gates, input_bias, hidden_bias):
    gates = _up(input_gates) + _up(hidden_gates)
    if input_bias is not None:
        gates = gates + _up(input_bias)
    if hidden_bias is not None:
        gates = gates + _up(hidden_bias)
    return gates


def _bias_grad(grad_gates, has_bias: bool, dtype):
    """The bias gradient: the gate gradient summed over the batch; zeros when the cell has no bias."""
    if has_bias:
        return jnp.sum(grad_gates, axis=0).astype(dtype)
    return jnp.zeros(grad_gates.shape[-1:], dtype)


@lowering(aten._thnn_fused_lstm_cell.default)
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """(hy, cy, workspace); workspace holds the activated gates i, f, g, o side by side."""
    i, f, g, o = jnp.split(_gates(input_gates, hidden_gates, input_bias, hidden_bias), 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * _up(cx) + i * g
    hy = o * jnp.tanh(cy)
    dtype = input_gates.dtype
    return hy.astype(dtype), cy.astype(dtype), jnp.concatenate([i, f, g, o], axis=-1).astype(dtype)


@lowering(aten._thnn_fused_lstm_cell_backward_impl.default)
def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """(gate gradient, cx gradient, bias gradient); an undefined grad_hy or grad_cy counts as zeros."""
    i, f, g, o = jnp.split(_up(workspace), 4, axis=-1)
    tanh_cy = jnp.tanh(_up(cy))
    d_cy = jnp.zeros_like(tanh_cy) if grad_cy is None else _up(grad_cy)
    d_o = jnp.zeros_like(tanh_cy)
    if grad_hy is not None:
        d_cy = d_cy + _up(grad_hy) * o * (1 - tanh_cy * tanh_cy)
        d_o = _up(grad_hy) * tanh_cy
    grad_gates = jnp.concatenate([d_cy * g * i * (1 - i), d_cy * _up(cx) * f * (1 - f),
                                  d_cy * i * (1 - g * g), d_o * o * (1 - o)], axis=-1)
    dtype = workspace.dtype
    return grad_gates.astype(dtype), (d_cy * f).astype(cx.dtype), _bias_grad(grad_gates, has_bias, dtype)


@lowering(aten._thnn_fused_gru_cell.default)
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """(hy, workspace); workspace holds r, z, n, the hidden part of n's pre-activation, and hx."""
    ib = jnp.split(_up(input_bias), 3) if input_bias is not None else (0, 0, 0)
    hb = jnp.split(_up(hidden_bias), 3) if hidden_bias is not None else (0, 0, 0)
    ir, iz, i_n = jnp.split(_up(input_gates), 3, axis=-1)
    hr, hz, h_n = jnp.split(_up(hidden_gates), 3, axis=-1)
    r = jax.nn.sigmoid(ir + hr + ib[0] + hb[0])
    z = jax.nn.sigmoid(iz + hz + ib[1] + hb[1])
    hidden_n = h_n + hb[2]
    n = jnp.tanh(i_n + ib[2] + r * hidden_n)
    hxf = _up(hx)
    hy = n + z * (hxf - n)
    dtype = input_gates.dtype
    return hy.astype(dtype), jnp.concatenate([r, z, n, hidden_n, hxf], axis=-1).astype(dtype)


@lowering(aten._thnn_fused_gru_cell_backward.default)
def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """(input gate, hidden gate, hx, input bias, hidden bias) gradients."""
    r, z, n, hidden_n, hx = jnp.split(_up(workspace), 5, axis=-1)
    g = _up(grad_hy)
    d_n = g * (1 - z) * (1 - n * n)
    d_z = g * (hx - n) * z * (1 - z)
    d_r = d_n * hidden_n * r * (1 - r)
    grad_input = jnp.concatenate([d_r, d_z, d_n], axis=-1)
    grad_hidden = jnp.concatenate([d_r, d_z, d_n * r], axis=-1)
    dtype = workspace.dtype
    return (grad_input.astype(dtype), grad_hidden.astype(dtype), (g * z).astype(dtype),
            _bias_grad(grad_input, has_bias, dtype), _bias_grad(grad_hidden, has_bias, dtype))
