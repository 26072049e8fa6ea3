"""Developer tools outside the serving path: demo-model builders (:mod:`.demo`) and benchmarks (:mod:`.bench`)."""
