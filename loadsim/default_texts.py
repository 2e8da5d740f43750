"""Texts of the built-in workload. The support manual is one long system prompt
that every `support-manual` request shares, so those requests exercise the
prefix cache; the articles are long prompts that take chunked prefill."""

ASSISTANT_SYSTEM = "You are a helpful assistant. Answer in one or two sentences."

SHORT_QUESTIONS = (
    "What is the capital of Australia?",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "What does a compiler do?",
    "Name three primary colors.",
    "What is the boiling point of water at sea level?",
    "Who wrote Pride and Prejudice?",
    "What is photosynthesis?",
    "How far is the Moon from the Earth?",
    "What is the difference between weather and climate?",
    "Give me a synonym for happy.",
    "What is a prime number?",
)

MANUAL_SYSTEM = (
    "You are the support assistant for the Aurora X2 home espresso machine. Answer only from this manual.\n"
    "Setup: unpack the machine, rinse the water tank, fill it with fresh cold water up to the MAX line and "
    "insert it at the back until it clicks. Plug the machine into a grounded outlet and press the power button; "
    "the ring light blinks white while the boiler heats and turns solid white after about 40 seconds.\n"
    "Brewing: fill the portafilter with 16 to 18 grams of finely ground coffee, tamp evenly, lock it into the "
    "group head and press the single or double cup button. A single shot takes 25 to 30 seconds. If the shot "
    "runs faster, grind finer; if it runs slower, grind coarser.\n"
    "Steam: turn the steam dial to the left; the ring light blinks blue while the thermoblock heats and turns "
    "solid blue when steam is ready. Purge the wand for two seconds before and after frothing.\n"
    "Cleaning: wipe the steam wand after every use. Backflush the group head with the blind basket once a week. "
    "Descale every 200 shots or when the ring light blinks orange: fill the tank with 500 ml of water and one "
    "sachet of descaler, hold the power and steam buttons together for five seconds, and follow the light.\n"
    "Error codes: E1 means the water tank is empty or not seated; E2 means the boiler is overheating, so switch "
    "off and let the machine cool for 30 minutes; E3 means a blocked pump, usually from scale, so descale; "
    "E4 means a sensor fault, so contact service.\n"
    "Warranty: two years for parts and labour from the date of purchase, void if the machine was used with "
    "unfiltered hard water without descaling."
)

MANUAL_QUESTIONS = (
    "The display shows E1. What should I do?",
    "How long should a single shot take?",
    "My espresso runs too fast. How do I fix it?",
    "How often do I need to descale?",
    "What does a blinking orange light mean?",
    "How do I get steam for milk?",
    "What does error E3 mean?",
    "Is the warranty still valid if I never descaled?",
    "How much coffee goes into the portafilter?",
    "The machine shows E2. Is it broken?",
)

CODE_PROMPTS = (
    "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "def is_palindrome(text: str) -> bool:\n",
    "SELECT customers.name, COUNT(orders.id) AS order_count\nFROM customers\n",
    "function debounce(fn, waitMs) {\n",
    "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n",
    "#include <stdio.h>\n\nint main(void) {\n",
)

SUMMARY_SYSTEM = "Summarize the user's text in three sentences."

ARTICLES = (
    "The history of the printing press begins long before Johannes Gutenberg. Woodblock printing was used in "
    "China by the seventh century, and movable type made of baked clay was described by Bi Sheng in the "
    "eleventh century. Korean printers cast movable metal type in the thirteenth century, and the oldest "
    "surviving book printed that way dates from 1377. In Europe, Gutenberg combined several existing "
    "technologies around 1450: a screw press adapted from wine and olive presses, an oil-based ink that stuck "
    "to metal, and a hand mould that cast letters of uniform height quickly. The result was a system that could "
    "produce books far faster and more cheaply than scribes. Within fifty years printing shops had spread to more "
    "than two hundred European cities, and millions of volumes had been produced. Historians credit the press "
    "with accelerating the Reformation, standardising spelling in many languages, and making scientific results "
    "easier to share and verify, because identical copies of a text could circulate widely. Critics at the time "
    "worried about the spread of errors and heresy, and several authorities introduced licensing and censorship "
    "regimes that lasted for centuries. The economic model of printing also changed authorship: printers needed "
    "texts that would sell, which encouraged vernacular works, pamphlets and eventually newspapers.",
    "Coral reefs cover less than one percent of the ocean floor but support roughly a quarter of all marine "
    "species. Reefs are built by colonies of tiny animals called polyps, which secrete calcium carbonate "
    "skeletons. Most reef-building corals live in partnership with microscopic algae that live inside their "
    "tissues, photosynthesise, and pass sugars to the coral in exchange for shelter and nutrients. This "
    "partnership explains why reefs grow in clear, shallow, sunlit water. When water temperatures rise only one "
    "or two degrees above the usual summer maximum for several weeks, corals expel their algae and turn white, a "
    "process called bleaching. Bleached corals are not dead, but they are starving, and if the heat persists "
    "many of them die. Mass bleaching events were rare before the 1980s; since then they have become more frequent "
    "and more widespread, with global events recorded in 1998, 2010, 2014 to 2017 and 2023 to 2024. Other "
    "pressures include pollution, sediment from coastal development, overfishing, and ocean acidification, which "
    "makes it harder for corals to build their skeletons. Restoration projects grow coral fragments in nurseries "
    "and transplant them, and researchers are breeding heat-tolerant strains, but most scientists agree that "
    "the long-term survival of reefs depends on limiting warming.",
    "A modern web browser is one of the most complex programs on a personal computer. When a user types an "
    "address, the browser resolves the name to an IP address through DNS, opens a TCP or QUIC connection, "
    "negotiates encryption with TLS, and sends an HTTP request. The server's response is parsed into a document "
    "object model, while style sheets are parsed into a separate tree of rules. The browser combines both to "
    "compute the style of every element, lays the elements out in boxes, paints them into layers, and composites "
    "the layers on the graphics processor. JavaScript can change the document at any time, which may force the "
    "browser to recompute styles and layout, so engines work hard to batch and defer that work. For security, "
    "each site runs in a sandboxed process with limited access to the operating system, and a same-origin "
    "policy stops one site's scripts from reading another site's data. Browsers also manage caches, cookies, "
    "service workers that run in the background, and extensions that can modify pages. Much of a browser's "
    "development effort goes into performance, compatibility with old and badly written pages, and defending "
    "against a steady stream of attacks.",
)
