"""Knowledge-graph tasks (LTG): 2-hop composition and k-hop chains, their
evaluation on probe splits, analyses, hop curriculum and grokking phases."""
