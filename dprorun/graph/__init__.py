"""The global dataflow graph: local DFGs per rank joined through In/Out virtual ops by a communication topology.

Entry point: dprorun.graph.build.build_global_dfg(run, iteration) -> dprorun.graph.dfg.GlobalDFG.
"""
