"""Running ATen ops on DTensors: unpack, propagate layouts, communicate, compute, repack."""

from shardwise.dispatch.dispatcher import dispatch, render_call

__all__ = ["dispatch", "render_call"]
