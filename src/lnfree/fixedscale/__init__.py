"""The fixed-scale machinery, the same for every family: the modules that stand in for a norm while it
is real, blending or fixed (`norms`), the per-token scale each of them divides by, real or a frozen σ
(`state`), the norm maths they share (`functional`), and the projection that reads one norm's input at
two fixed scales in one matmul (`rescaled`). Which modules go where in a model is the family adapter's
answer (`lnfree.arch`); installing and switching them is `lnfree.fixedscale.surgery`.
"""
