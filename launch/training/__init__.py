"""``train-tiny``: small MoE models trained on the shipped text, so their routing is real.

``model`` (a trainable full-sequence model in the checkpoint's layout), ``corpus`` (the
shipped training text by kind), ``report`` (per-workload routing and loss), ``train`` (the
loop and the command).
"""
