"""What XLA compiled, read back and priced: the program's text parsed (`hlo_text`), its
collectives counted and sized (`collectives`, with their device groups: `groups`), its memory
(`memory`), its kernels (`kernels`), and the referee that prices any compiled program on a
cluster, serially and as its schedule runs (`compiled_cost`, replaying it on `timeline`)."""
