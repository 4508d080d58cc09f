"""The replayer (dPRO §4.3): simulate one iteration of the global DFG on per-device queues.

Entry points: engine.replay(ReplayGraph) -> ReplayResult; whatif.predict(run, WhatIf) -> Prediction.
"""
