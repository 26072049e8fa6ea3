"""What runs inside Triton, in its python-backend stubs: the BLS entry model of each mode (:mod:`.scheduler`), a
stage model's stub, which relays Triton's requests to its worker (:mod:`.proxy_model`, with its engine metrics:
:mod:`.stage_metrics`), the head's bind model (:mod:`.bind_model`), and the metrics they publish (:mod:`.metrics`).

These import no torch: a stub's Python is Triton's, and each model loads in its own stub process."""
