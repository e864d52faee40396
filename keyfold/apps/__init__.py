"""Applications built on the keyfold library; each brings its own extra.

========================  =====================================  ============================
``apps.translate``        the paper's Transformer on German-English  ``pip install 'keyfold[translate]'``
``apps.toolbox``          attention beside GRU/LSTM/TCN/linear/SSM   ``pip install 'keyfold[toolbox]'``
``apps.verify``           error bounds, certified bounds, streaming  ``pip install 'keyfold[verify]'``
``apps.control``          predictors in a safe real-time loop        ``pip install 'keyfold[control]'``
========================  =====================================  ============================

Apps import the library (``keyfold.*``), never the other way round.
"""
