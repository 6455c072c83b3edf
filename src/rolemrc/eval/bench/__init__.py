"""Role-play benchmarks from their authors' released files, scored as their scripts score
(one module per benchmark, each registered in :data:`rolemrc.eval.suites.SUITES`)."""
