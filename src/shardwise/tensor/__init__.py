"""The DTensor and what makes one: the tensor subclass (``dtensor``), ``distribute_tensor`` and
the factories (``factories``), ``distribute_module``, ``local_map``, layout-independent random
values (``random``), from_local's agreement check across ranks (``agreement``), gradient
clipping and ``torch.load`` support.
"""
