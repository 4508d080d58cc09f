"""The replayer (dPRO §4.3): build the global DFG and simulate one iteration of it on per-device queues.

Entry points: synthesize.synthesize(JobModel, WhatIf) -> ReplayGraph (the global DFG at op level);
engine.replay(ReplayGraph) -> ReplayResult; coarsen.coarsen(ReplayGraph) -> ReplayGraph;
predict.predict(JobModel, WhatIf) -> Prediction.
"""
