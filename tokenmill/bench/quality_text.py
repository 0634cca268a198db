"""A fixed English text for perplexity checks (written for tokenmill; plain prose on everyday topics,
so that a small instruct model finds it predictable but not trivial)."""

QUALITY_TEXT = """\
The town sits where the river bends twice before it reaches the sea. In the morning the fishing boats go out \
while the streets are still wet from the night, and by the time the bakery opens its shutters the first of them \
are already coming back. People here measure the seasons by the fish that are in the market: mackerel in the \
summer, herring when the weather turns cold, and nothing much at all in the weeks after the winter storms.

Most of the houses along the harbour were built more than two hundred years ago, from the grey stone that was \
cut out of the hill behind the church. Their walls are thick and their windows are small, because the wind off \
the water can be fierce. Inside, they are warmer than they look. Many of them have been turned into small shops \
and cafes, and in the tourist season the harbour is crowded with visitors who have come to walk along the cliffs \
and eat fish and chips on the sea wall.

A computer stores information as numbers, and every number is made of bits, each of which can be either zero or \
one. A program is a list of instructions that tells the processor what to do with those numbers: add them, \
compare them, copy them from one place in memory to another. Modern processors can carry out billions of such \
instructions every second, but they often spend much of their time waiting for data to arrive from memory. For \
this reason, engineers try to keep the data a program needs close to the processor, in small and fast caches.

Learning to cook is mostly a matter of practice. The first time you make bread, it will probably be too dense, \
because the dough did not rise for long enough or the oven was not hot enough. The second time will be better. \
After a few weeks you begin to notice how the dough should feel under your hands, and you stop looking at the \
recipe. Good cooks pay attention to small things: the smell of onions as they soften in the pan, the sound of \
oil when it is ready, the colour of a sauce just before it starts to burn.

The history of the bicycle is longer than many people think. The first machines, built in the early nineteenth \
century, had no pedals at all; riders pushed themselves along with their feet. Pedals were later attached to the \
front wheel, which led to the famous high-wheeled bicycles with their enormous front wheels and tiny rear ones. \
These were fast but dangerous, and it was only with the invention of the chain drive and the air-filled tyre that \
the bicycle took the shape we know today. Within a few years, millions of people were riding them to work.

Sleep is one of the most important things we do, and yet scientists are still not sure exactly why we need it. \
During sleep the brain seems to sort through the events of the day, keeping some memories and letting others \
fade. People who do not get enough sleep find it harder to concentrate, make more mistakes, and are more likely \
to catch a cold. Most adults need between seven and nine hours each night, although some claim to manage well on \
much less.
"""
