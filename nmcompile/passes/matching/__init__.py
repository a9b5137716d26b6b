"""What the passes share, none of it a pass: which graph nodes use a weight and how (:mod:`.gemm_uses`), where a
parameter placeholder comes from and which module owns it (:mod:`.sources`), and the rows that reach a
calibrated weight's GEMMs (:mod:`.calibration_routes`)."""
