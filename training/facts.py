"""Built-in tables the synthetic corpus draws from.

Everything the demo model "knows" comes from here, so the corpus is reproducible offline.
Cities are split into a training list and a held-out list: the evaluation asks about
held-out cities, so a correct tool call there means the model copies the argument from
the prompt instead of recalling a memorised chat.
"""

from __future__ import annotations

# country -> (capital, continent, language)
COUNTRIES: dict[str, tuple[str, str, str]] = {
    "France": ("Paris", "Europe", "French"),
    "Germany": ("Berlin", "Europe", "German"),
    "Italy": ("Rome", "Europe", "Italian"),
    "Spain": ("Madrid", "Europe", "Spanish"),
    "Portugal": ("Lisbon", "Europe", "Portuguese"),
    "Poland": ("Warsaw", "Europe", "Polish"),
    "Greece": ("Athens", "Europe", "Greek"),
    "Sweden": ("Stockholm", "Europe", "Swedish"),
    "Norway": ("Oslo", "Europe", "Norwegian"),
    "Finland": ("Helsinki", "Europe", "Finnish"),
    "Austria": ("Vienna", "Europe", "German"),
    "Ireland": ("Dublin", "Europe", "English"),
    "Japan": ("Tokyo", "Asia", "Japanese"),
    "China": ("Beijing", "Asia", "Chinese"),
    "India": ("New Delhi", "Asia", "Hindi"),
    "Thailand": ("Bangkok", "Asia", "Thai"),
    "Vietnam": ("Hanoi", "Asia", "Vietnamese"),
    "Indonesia": ("Jakarta", "Asia", "Indonesian"),
    "Egypt": ("Cairo", "Africa", "Arabic"),
    "Kenya": ("Nairobi", "Africa", "Swahili"),
    "Nigeria": ("Abuja", "Africa", "English"),
    "Morocco": ("Rabat", "Africa", "Arabic"),
    "Canada": ("Ottawa", "North America", "English"),
    "Mexico": ("Mexico City", "North America", "Spanish"),
    "Brazil": ("Brasilia", "South America", "Portuguese"),
    "Argentina": ("Buenos Aires", "South America", "Spanish"),
    "Peru": ("Lima", "South America", "Spanish"),
    "Chile": ("Santiago", "South America", "Spanish"),
    "Australia": ("Canberra", "Oceania", "English"),
    "New Zealand": ("Wellington", "Oceania", "English"),
}

# element -> (symbol, atomic number)
ELEMENTS: dict[str, tuple[str, int]] = {
    "hydrogen": ("H", 1), "helium": ("He", 2), "lithium": ("Li", 3), "carbon": ("C", 6),
    "nitrogen": ("N", 7), "oxygen": ("O", 8), "fluorine": ("F", 9), "neon": ("Ne", 10),
    "sodium": ("Na", 11), "magnesium": ("Mg", 12), "aluminium": ("Al", 13), "silicon": ("Si", 14),
    "sulfur": ("S", 16), "chlorine": ("Cl", 17), "argon": ("Ar", 18), "potassium": ("K", 19),
    "calcium": ("Ca", 20), "iron": ("Fe", 26), "copper": ("Cu", 29), "zinc": ("Zn", 30),
    "silver": ("Ag", 47), "tin": ("Sn", 50), "gold": ("Au", 79), "mercury": ("Hg", 80),
    "lead": ("Pb", 82),
}

# Cities used by the weather / time tools.  EVAL_CITIES never occur in training data.
TRAIN_CITIES: list[str] = [
    "Paris", "Berlin", "Rome", "Madrid", "Lisbon", "Warsaw", "Athens", "Stockholm", "Oslo",
    "Helsinki", "Vienna", "Dublin", "Tokyo", "Beijing", "Bangkok", "Hanoi", "Jakarta", "Cairo",
    "Nairobi", "Rabat", "Ottawa", "Lima", "Santiago", "Canberra", "Wellington", "London",
    "Amsterdam", "Brussels", "Prague", "Budapest", "Zurich", "Geneva", "Munich", "Hamburg",
    "Milan", "Naples", "Barcelona", "Seville", "Porto", "Krakow", "Copenhagen", "Reykjavik",
    "Edinburgh", "Manchester", "Lyon", "Marseille", "Toronto", "Vancouver", "Montreal",
    "Chicago", "Boston", "Seattle", "Denver", "Houston", "Miami", "Atlanta", "Phoenix",
    "Dallas", "Osaka", "Kyoto", "Seoul", "Busan", "Shanghai", "Shenzhen", "Mumbai", "Chennai",
    "Kolkata", "Dubai", "Doha", "Istanbul", "Ankara", "Tehran", "Karachi", "Lagos", "Accra",
    "Dakar", "Tunis", "Algiers", "Casablanca", "Johannesburg", "Cape Town", "Sydney",
    "Melbourne", "Perth", "Brisbane", "Auckland", "Quito", "Bogota", "Caracas", "Havana",
]
EVAL_CITIES: list[str] = [
    "Florence", "Valencia", "Bergen", "Gdansk", "Salzburg", "Tampere", "Nagoya", "Sapporo",
    "Pune", "Lucknow", "Cusco", "Rosario", "Calgary", "Halifax", "Portland", "Austin",
    "Adelaide", "Hobart", "Marrakesh", "Mombasa",
]

CONDITIONS: list[str] = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]

# Words for string tasks and search queries.  EVAL_WORDS never occur in training data.
TRAIN_WORDS: list[str] = [
    "apple", "banana", "river", "mountain", "garden", "window", "rocket", "planet", "yellow",
    "purple", "silver", "pencil", "bottle", "candle", "castle", "dragon", "forest", "guitar",
    "hammer", "island", "jacket", "kitten", "ladder", "magnet", "needle", "orange", "parrot",
    "rabbit", "saddle", "tomato", "turtle", "violin", "wallet", "zebra", "anchor", "basket",
    "cactus", "desert", "engine", "falcon", "glacier", "harbor", "igloo", "jungle", "kernel",
    "lemon", "meadow", "napkin", "oyster", "pepper", "quartz", "rubber", "spider", "ticket",
    "umbrella", "valley", "walnut", "yogurt", "bridge", "cookie", "dollar", "feather", "ginger",
    "helmet", "insect", "jigsaw", "kettle", "lizard", "mirror", "noodle", "onion", "pillow",
    "riddle", "summer", "tunnel", "velvet", "winter", "butter", "copper", "donkey", "eagle",
]
EVAL_WORDS: list[str] = [
    "lantern", "marble", "pebble", "saffron", "thimble", "walrus", "biscuit", "compass",
    "dolphin", "emerald", "fossil", "gazelle", "hazel", "iris", "juniper", "koala",
]

# Search-query topics (two-word phrases are built from these and the word lists).
TRAIN_TOPICS: list[str] = [
    "python lists", "sorting algorithms", "prime numbers", "black holes", "solar panels",
    "machine learning", "ancient rome", "coffee brewing", "chess openings", "ocean tides",
    "volcano eruptions", "bird migration", "jazz music", "electric cars", "tea ceremonies",
    "roman numerals", "binary search", "hash tables", "climate change", "vitamin c",
    "plate tectonics", "the moon landing", "bread baking", "rainbow colors", "wind turbines",
    "honey bees", "paper folding", "deep sea fish", "desert plants", "mountain climbing",
]
EVAL_TOPICS: list[str] = [
    "quantum computing", "coral reefs", "medieval castles", "sourdough starters",
    "northern lights", "glass blowing", "linked lists", "solar eclipses",
]

UNITS: dict[tuple[str, str], int] = {
    ("km", "m"): 1000, ("m", "cm"): 100, ("kg", "g"): 1000, ("hours", "minutes"): 60,
    ("minutes", "seconds"): 60, ("liters", "ml"): 1000, ("days", "hours"): 24,
}

SMALL_TALK: list[tuple[str, str]] = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What can I do for you?"),
    ("Good morning!", "Good morning! How can I help you today?"),
    ("Thank you!", "You are welcome! Let me know if you need anything else."),
    ("Thanks for the help.", "You are welcome! Let me know if you need anything else."),
    ("Who are you?", "I am a tiny demo assistant. I can answer simple questions and call tools."),
    ("What can you do?", "I can answer simple questions, do small sums and call tools such as weather and search."),
    ("Goodbye.", "Goodbye! Have a nice day."),
    ("How are you?", "I am fine, thank you. How can I help you today?"),
    ("Tell me a joke.", "Why did the computer go to the doctor? Because it had a virus."),
]

# Extra city names for the copy stage (stage 3): real places, none of them in TRAIN_CITIES or
# EVAL_CITIES. With the syllable-built names of corpus.copy_names() they make thousands of
# distinct names, too many to memorise, so a weather / time call can only get its argument
# right by copying it from the prompt.
COPY_CITIES: list[str] = [
    "Aberdeen", "Abidjan", "Acapulco", "Addis Ababa", "Agra", "Albany", "Alexandria", "Almaty",
    "Amman", "Anchorage", "Antwerp", "Arequipa", "Asuncion", "Baghdad", "Baku", "Bali", "Baltimore",
    "Bamako", "Bangalore", "Bari", "Basel", "Beirut", "Belfast", "Belgrade", "Bilbao", "Birmingham",
    "Bologna", "Bordeaux", "Bratislava", "Bremen", "Brighton", "Bristol", "Brno", "Bucharest",
    "Buffalo", "Cadiz", "Cali", "Cambridge", "Cardiff", "Cartagena", "Catania", "Charlotte",
    "Chiang Mai", "Cleveland", "Cologne", "Colombo", "Cordoba", "Cork", "Curitiba", "Damascus",
    "Darwin", "Delft", "Detroit", "Dhaka", "Dortmund", "Dresden", "Dundee", "Durban", "Dusseldorf",
    "Eindhoven", "Essen", "Faro", "Fez", "Frankfurt", "Fukuoka", "Galway", "Genoa", "Ghent",
    "Glasgow", "Gothenburg", "Granada", "Graz", "Guadalajara", "Guangzhou", "Hanover", "Harare",
    "Hiroshima", "Honolulu", "Hyderabad", "Ibiza", "Innsbruck", "Irkutsk", "Izmir",
    "Jaipur", "Jeddah", "Kabul", "Kampala", "Kathmandu", "Kazan", "Kiev", "Kingston", "Kobe",
    "Kuala Lumpur", "Kuwait City", "La Paz", "Lahore", "Las Vegas", "Leeds", "Leipzig", "Lille",
    "Limerick", "Linz", "Liverpool", "Ljubljana", "Lodz", "Los Angeles", "Luanda", "Lublin",
    "Lusaka", "Luxor", "Lviv", "Macau", "Malaga", "Malmo", "Managua", "Manila", "Maputo",
    "Mecca", "Medellin", "Memphis", "Mendoza", "Minsk", "Mogadishu", "Monaco", "Monterrey",
    "Montevideo", "Moscow", "Muscat", "Nantes", "Nashville", "New Orleans", "New York", "Nice",
    "Nicosia", "Novosibirsk", "Nuremberg", "Odessa", "Orlando", "Oxford", "Palermo", "Panama City",
    "Pisa", "Pittsburgh", "Plymouth", "Poznan", "Puebla", "Quebec", "Recife", "Riga", "Rio",
    "Riyadh", "Rotterdam", "Sacramento", "Samara", "San Diego", "San Jose", "Sarajevo", "Sendai",
    "Sheffield", "Siena", "Skopje", "Sofia", "Split", "Stuttgart", "Suva",
    "Surabaya", "Taipei", "Tallinn", "Tangier", "Tbilisi", "Tel Aviv", "Tijuana", "Toledo",
    "Toulouse", "Trieste", "Tripoli", "Trondheim", "Tucson", "Turin", "Turku", "Utrecht",
    "Uppsala", "Venice", "Verona", "Vilnius", "Vladivostok", "Windhoek", "Winnipeg", "Wroclaw",
    "Xian", "Yangon", "Yerevan", "Yokohama", "Zagreb", "Zanzibar", "Zaragoza",
]

# Syllables the copy stage builds made-up place names from (seeded, see corpus.copy_names).
NAME_ONSETS: list[str] = ["b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "kr", "l", "m",
                          "n", "p", "pr", "qu", "r", "s", "sh", "st", "t", "tr", "v", "w", "y", "z", ""]
NAME_VOWELS: list[str] = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "ie", "y"]
NAME_CODAS: list[str] = ["", "", "", "n", "r", "l", "s", "m", "th", "nd", "rk", "ck", "x", "sk", "lt"]
NAME_AFFIXES: list[str] = ["New {}", "Port {}", "San {}", "{} City", "{} Falls", "Lake {}", "Saint {}", "{}ville"]
