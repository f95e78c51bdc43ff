"""Coarsening (Rhino, section 4.3): the critical nodes of the compute chain (`critical`), the
cones around them (`cones`), repeated segments tied (`repeats`), and a coarser mesh's plan as a
start (`coarse_axes`)."""
